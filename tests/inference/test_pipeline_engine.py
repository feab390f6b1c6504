"""Pipeline-parallel inference (`meshtron.inference.pipeline_engine`, gloo ranks; NCCL under
MESHTRON_TEST_BACKEND=nccl) against the single-process engine: the same greedy tokens for mixed prompt
lengths with chunked prefill and preemption (a small KV pool), for dense, MoE and hybrid Mamba models,
pp2 and pp2 x tp2, with pp steps in flight at once (and steps cut into micro-batches); each stage's KV memory is the single-process figure times its share of the
attention layers (its Mamba states likewise); a per-rank KV budget holds pp times the blocks."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import ConfigError, ModelConfig
from meshtron.inference.scheduler import ScheduledChunk
from meshtron.models import GPTModel
from meshtron.testing.multiprocess import rank_backend, rank_device_type, run_ranks
from tests.inference.helpers import TOKENIZER, engine, greedy_params, save_tiny_checkpoint, tiny_model, workload

# 12 blocks of 4 tokens for 8 requests of up to 25 tokens: preemption; 16 tokens a step: chunked prefill
ENGINE = dict(num_blocks=12, block_size=4, max_num_batched_tokens=16)


def build_model(kind: str) -> GPTModel:
    if kind == "hybrid":  # attention in the first stage only, Mamba in both
        torch.manual_seed(0)
        cfg = ModelConfig(layer_pattern="M*-M-", hidden_size=32, num_attention_heads=4, mamba_head_dim=8,
                          mamba_num_groups=2, mamba_state_dim=6, mamba_chunk_size=8, max_position_embeddings=96,
                          make_vocab_size_divisible_by=1, init_method_std=0.2)
        return GPTModel(cfg, TOKENIZER.vocab_size).eval()
    return tiny_model(kind)


def count_preemptions(eng) -> list[str]:
    """Record the ids of the requests the engine's scheduler preempts."""
    seen, preempt = [], eng.scheduler._preempt

    def recording(request):
        seen.append(request.req_id)
        preempt(request)

    eng.scheduler._preempt = recording
    return seen


def state_bytes(runner) -> dict[int, int]:
    if runner.states is None:
        return {}
    return {i: runner.states.conv[i].nbytes + runner.states.ssm[i].nbytes for i in runner.states.conv}


def pipeline_rank(rank: int, world_size: int, pp: int, tp: int, kind: str, prompts, max_tokens, options,
                  checkpoint=None):
    """One rank of a pp x tp pipeline engine over `build_model(kind)`, or `checkpoint`'s model loaded
    stage by stage (how `meshtron serve --pp` builds it)."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshtron.inference.config import EngineConfig
    from meshtron.inference.pipeline_engine import build_pipeline_member, load_pipeline_member
    from meshtron.inference.tp_serving import Leader, lead
    from meshtron.parallel.dims import ParallelDims

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=120))
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=pp, ep=1, world_size=world_size)
    mesh = dims.build_mesh(rank_device_type(), 120)
    config = EngineConfig(device=rank_device_type(), **options)
    where = dict(pp_group=mesh["pp"].get_group(), tp_mesh=mesh["tp"] if tp > 1 else None, timeout_s=120)
    if checkpoint is not None:
        member = load_pipeline_member(checkpoint, config, **where)
    else:
        member = build_pipeline_member(build_model(kind).to(rank_device_type()), TOKENIZER, config, **where)
    stage = {"stage": member.link.stage, "num_blocks": member.runner.cfg.num_blocks}
    if not member.is_leader:
        member.follow()
        return {**stage, "kv_bytes": member.runner.cache.num_bytes, "state_bytes": state_bytes(member.runner)}
    eng = lead(member.engine, Leader(member.messages))
    preempted = count_preemptions(eng)
    outputs = eng.generate(prompts, greedy_params(max_tokens))
    forwards = dict(eng.runner.num_forwards)
    eng.shutdown()  # releases the followers
    return {**stage, "kv_bytes": member.runner.cache.num_bytes, "state_bytes": state_bytes(member.runner),
            "tokens": [o.token_ids for o in outputs], "preempted": len(preempted), "steps": eng.num_steps,
            "forwards": forwards, "max_in_flight": eng.max_in_flight}


def single_process(kind: str, prompts, max_tokens, options=ENGINE):
    eng = engine(build_model(kind), device="cpu", **options)
    preempted = count_preemptions(eng)
    tokens = [o.token_ids for o in eng.generate(prompts, greedy_params(max_tokens))]
    return eng, tokens, len(preempted)


def attention_share(kind: str, pp: int, stage: int) -> float:
    from meshtron.inference.pipeline_engine import stage_ranges

    pattern = build_model(kind).cfg.pattern
    mine = sum(pattern[i] == "*" for i in stage_ranges(len(pattern), pp)[stage])
    return mine / pattern.count("*")


def check_against_single_process(kind: str, pp: int, tp: int, options=ENGINE, num_requests: int = 8,
                                 checkpoint=None):
    prompts, max_tokens = workload(num_requests, max_prompt=20, max_output=10)
    single, expected, preempted = single_process(kind, prompts, max_tokens)
    assert preempted > 0  # the workload does exercise preemption
    assert any(len(p) > options["max_num_batched_tokens"] for p in prompts)  # and chunked prefill
    results = run_ranks("tests.inference.test_pipeline_engine:pipeline_rank", pp * tp, timeout_s=300, pp=pp, tp=tp,
                        kind=kind, prompts=prompts, max_tokens=max_tokens, options=options, checkpoint=checkpoint)
    leader = results[(pp - 1) * tp]  # tp rank 0 of the last stage leads
    assert leader["tokens"] == expected
    assert leader["preempted"] > 0
    assert leader["max_in_flight"] == pp  # every stage had a step of its own at once
    if options.get("pp_micro_batches", 0) > 1:  # steps were cut into micro-batches (a one-request step is one)
        assert leader["forwards"]["varlen"] > leader["steps"]
    single_states = state_bytes(single.runner)
    for r in results:
        assert r["num_blocks"] == single.config.num_blocks  # one block table for every stage
        share = attention_share(kind, pp, r["stage"])
        assert r["kv_bytes"] * tp == single.runner.cache.num_bytes * share
        pattern = single.runner.model.cfg.pattern
        from meshtron.inference.pipeline_engine import stage_ranges

        mamba_here = [i for i in stage_ranges(len(pattern), pp)[r["stage"]] if pattern[i] == "M"]
        assert sorted(r["state_bytes"]) == mamba_here  # the stage's own Mamba layers, nothing else
        assert {i: b * tp for i, b in r["state_bytes"].items()} == {i: single_states[i] for i in mamba_here}
    return results


def test_pp2_dense_from_a_checkpoint_equals_single_process_and_kv_per_stage(tmp_path):
    # the stages load their own parameters from the checkpoint, as `meshtron serve --pp 2` does
    check_against_single_process("gqa-rope", pp=2, tp=1, checkpoint=save_tiny_checkpoint(tmp_path / "ckpt"))


@pytest.mark.parametrize("kind", ["moe", "hybrid"])
def test_pp2_moe_and_hybrid_mamba_equal_single_process(kind):
    # the hybrid model's steps are also cut into two micro-batches each
    check_against_single_process(kind, pp=2, tp=1, options={**ENGINE, "pp_micro_batches": 2} if kind == "hybrid" else ENGINE)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gqa-rope", "moe"])
def test_pp2_tp2_equals_single_process(kind, tmp_path):
    # the dense model from a checkpoint: each stage sharded over tp before its parameters load
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt") if kind == "gqa-rope" else None
    check_against_single_process(kind, pp=2, tp=2, checkpoint=checkpoint)


def test_per_rank_kv_budget_holds_pp_times_the_blocks():
    """kv_cache_memory_mb is per rank: a stage of half the attention layers fits twice the blocks."""
    options = dict(kv_cache_memory_mb=0.05, block_size=4, max_num_batched_tokens=16)
    prompts, max_tokens = workload(4, max_prompt=12, max_output=6)
    single, expected, _ = single_process("gqa-rope", prompts, max_tokens, options)
    results = run_ranks("tests.inference.test_pipeline_engine:pipeline_rank", 2, timeout_s=300, pp=2, tp=1,
                        kind="gqa-rope", prompts=prompts, max_tokens=max_tokens, options=options)
    budget = int(0.05 * 2**20)
    per_token_single = single.runner.cache.num_bytes // ((single.config.num_blocks + 1) * 4)
    assert single.config.num_blocks == budget // (per_token_single * 4)
    assert [r["num_blocks"] for r in results] == [budget // (per_token_single // 2 * 4)] * 2
    assert results[1]["tokens"] == expected


def _chunks(sizes: list[int]) -> list[ScheduledChunk]:
    return [ScheduledChunk(f"r{i}", [0] * n, 0, [0], True) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("sizes,count", [([1] * 7, 2), ([16, 1, 1, 1], 2), ([3, 5, 2, 8, 1, 1], 3), ([4], 3),
                                         ([1, 1], 4), ([9, 9, 1], 2)])
def test_micro_batches_are_consecutive_balanced_runs(sizes, count):
    from meshtron.inference.pipeline_engine import split_micro_batches

    groups = split_micro_batches(_chunks(sizes), count)
    assert [c.req_id for g in groups for c in g] == [f"r{i}" for i in range(len(sizes))]  # all, in order
    assert len(groups) == min(count, len(sizes)) and all(groups)
    # no cut point moved by one chunk gives a smaller largest group (brute force over every split)
    import itertools

    best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
               for cuts in itertools.combinations(range(1, len(sizes)), len(groups) - 1))
    assert max(sum(len(c.token_ids) for c in g) for g in groups) <= 2 * best


def test_stage_ranges_are_the_training_split_when_even():
    from meshtron.inference.pipeline_engine import stage_ranges
    from meshtron.parallel.pipeline_stages import split_layers

    assert stage_ranges(8, 2) == split_layers(8, 2)
    assert stage_ranges(8, 4, first=1, last=3) == split_layers(8, 4, 1, 3)
    assert stage_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ConfigError, match="--pp"):
        stage_ranges(2, 3)


def test_cuda_graphs_are_refused_under_pp():
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.pipeline_engine import build_stage, resolve_pipeline_config

    stage = build_stage(tiny_model(), [range(0, 2), range(2, 4)], 0)
    with pytest.raises(ConfigError, match="engine.cuda_graphs"):
        resolve_pipeline_config(stage, EngineConfig(cuda_graphs=True), torch.device("cpu"), None)


def interrupted_rank(rank: int, world_size: int, prompts, max_tokens):
    """The leader aborts a request while its step is in flight and suspends and resumes with steps in
    flight; -> the finished outputs by request (leader), None (follower)."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshtron.inference.config import EngineConfig
    from meshtron.inference.pipeline_engine import build_pipeline_member
    from meshtron.inference.tp_serving import Leader, lead
    from meshtron.parallel.dims import ParallelDims

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=120))
    mesh = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=2).build_mesh(rank_device_type(), 120)
    member = build_pipeline_member(build_model("gqa-rope").to(rank_device_type()), TOKENIZER,
                                   EngineConfig(device=rank_device_type(), **ENGINE), pp_group=mesh["pp"].get_group(),
                                   timeout_s=120)
    if not member.is_leader:
        member.follow()
        return None
    eng = lead(member.engine, Leader(member.messages))
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, greedy_params(max_tokens))]
    finished, aborted = {}, None
    for step in range(12):
        finished.update({o.req_id: o for o in eng.step() if o.finished})
        if step == 3:
            aborted = next(iter(eng._flying))  # a request whose step is in flight
            assert eng.abort(aborted)
        if step == 6:
            assert eng._in_flight  # suspend waits for the steps in flight
            eng.suspend()
            eng.resume()
    while eng.has_unfinished_requests():
        finished.update({o.req_id: o for o in eng.step() if o.finished})
    eng.shutdown()
    return {i: finished[i].token_ids for i in ids if i != aborted}, ids.index(aborted)


def test_pp2_abort_in_flight_and_suspend_resume_keep_the_other_outputs():
    prompts, max_tokens = workload(8, max_prompt=20, max_output=10)
    _, expected, _ = single_process("gqa-rope", prompts, max_tokens)
    outputs, aborted = run_ranks("tests.inference.test_pipeline_engine:interrupted_rank", 2, timeout_s=300,
                                 prompts=prompts, max_tokens=max_tokens)[1]
    assert len(outputs) == len(prompts) - 1
    for i, tokens in enumerate(expected):
        if i != aborted:
            assert outputs[f"req-{i}"] == tokens
