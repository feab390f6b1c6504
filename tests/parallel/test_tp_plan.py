"""`meshtron plan`'s tensor-parallel placements against what `apply_tp` really builds on 2 ranks: every
parameter's DTensor placement (or plain tensor) and local shape, for dense, GQA, multi-latent, MoE and
Mamba-hybrid models with and without sequence parallelism; the symbol registries of models/ and
parallel/ agree; multi-latent attention under TP2 trains like one process."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from meshtron.config import load_config
from meshtron.config.hybrid import LAYER_SYMBOLS
from meshtron.models.blocks import SUBLAYERS
from meshtron.parallel import plan as planner
from meshtron.parallel import tensor_parallel
from meshtron.testing.multiprocess import run_ranks

TINY = {"model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
        "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
        "data.seq_length": "32", "train.micro_batch_size": "2", "train.global_batch_size": "8",
        "parallel.tp": "2"}
MODELS = {
    "dense": {"model.num_query_groups": "4", "model.tie_word_embeddings": "true",
              "model.position_embedding_type": "learned_absolute", "model.add_bias_linear": "true",
              "model.add_qkv_bias": "true", "model.activation": "gelu", "model.normalization": "LayerNorm"},
    "gqa": {"model.softmax_type": "learnable", "model.qk_layernorm": "true"},
    "mla": {"model.multi_latent_attention": "true", "model.q_lora_rank": "16", "model.kv_lora_rank": "16",
            "model.qk_head_dim": "8", "model.qk_pos_emb_head_dim": "4", "model.v_head_dim": "8",
            "model.softmax_type": "learnable"},
    "moe": {"model.layer_pattern": "*E*-", "model.num_moe_experts": "4", "model.moe_router_topk": "2",
            "model.moe_ffn_hidden_size": "32", "model.moe_shared_expert_intermediate_size": "32"},
    "mamba": {"model.layer_pattern": "M-*M", "model.mamba_head_dim": "8", "model.mamba_num_groups": "2",
              "model.mamba_state_dim": "4", "model.mamba_chunk_size": "8", "model.mamba_conv_bias": "true"},
}
CASES = [(name, sp) for name in MODELS for sp in ("true", "false")]


def case_config(name: str, sp: str):
    return load_config(overrides={**TINY, **MODELS[name], "parallel.sequence_parallel": sp}, world_size=2)


def real_placements(rank: int, world_size: int) -> dict:
    """On each rank: apply_tp to every case's model; name -> (placement or None, local shape)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from meshtron.models.gpt import GPTModel
    from meshtron.testing.multiprocess import rank_backend, rank_device, rank_device_type

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=60))
    mesh = init_device_mesh(rank_device_type(), (world_size,), mesh_dim_names=("tp",))
    out = {}
    for name, sp in CASES:
        cfg = case_config(name, sp)
        with torch.device(rank_device()):
            model = GPTModel(cfg.model, planner.vocab_size(cfg))
        tensor_parallel.apply_tp(model, mesh["tp"], sequence_parallel=cfg.parallel.sequence_parallel,
                                 loss_parallel=cfg.parallel.loss_parallel)
        out[name, sp] = {n: (tuple(p.placements), tuple(p.to_local().shape)) if isinstance(p, DTensor)
                         else (None, tuple(p.shape)) for n, p in model.named_parameters()}
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks("tests.parallel.test_tp_plan:real_placements", 2, timeout_s=240)


def mismatches(real: dict, rows: list[dict]) -> list[str]:
    """Parameters whose planned placement or local shape differs from the rank's real one."""
    planned = {r["name"]: ((r["tp_placement"],) if r["tp_placement"] is not None else None, r["tp_local_shape"])
               for r in rows}
    assert planned.keys() == real.keys()
    return [f"{n}: planned {planned[n]}, real {real[n]}" for n in real if planned[n] != real[n]]


@pytest.mark.parametrize("name, sp", CASES)
def test_plan_reports_the_placements_apply_tp_makes(ranks, name, sp):
    cfg = case_config(name, sp)
    for rank, real in enumerate(ranks):
        assert mismatches(real[name, sp], planner.parameter_layout(cfg, 2, tp_rank=rank)) == []
    distributed = [n for n, (placement, _) in ranks[0][name, sp].items() if placement is not None]
    assert len(distributed) > len(ranks[0][name, sp]) // 2  # most of the model is a DTensor
    # the memory plan holds rank 0's local parameters: 4 bytes per element
    (row,) = planner.estimate_memory(cfg, 2)
    assert row["param_bytes"] == 4 * sum(torch.Size(shape).numel() for _, shape in ranks[0][name, sp].values())


def test_a_changed_plan_is_caught(ranks, monkeypatch):
    """The comparison fails when the planner's plan is changed: w_up row- instead of column-parallel."""
    def swapped_mlp(mixer, seq, output=None):
        return [(path, tensor_parallel.RowwiseParallel() if path == "w_up" else style)
                for path, style in tensor_parallel.mlp_plan(mixer, seq, output)]

    cfg = case_config("gqa", "true")
    monkeypatch.setitem(tensor_parallel.TP_PLANS, "-", swapped_mlp)
    found = mismatches(ranks[0]["gqa", "true"], planner.parameter_layout(cfg, 2))
    assert found and all(".mixer.w_up.weight" in line for line in found)


def test_a_changed_placement_rule_is_caught(ranks, monkeypatch):
    """... and when a style's placement rule is changed: row-parallel biases sharded instead of whole."""
    rule = planner.style_placements

    def sharded_bias(style, module):
        return {n: planner.Shard(0) if n == "bias" else p for n, p in rule(style, module).items()}

    monkeypatch.setattr(planner, "style_placements", sharded_bias)
    found = mismatches(ranks[0]["dense", "false"], planner.parameter_layout(case_config("dense", "false"), 2))
    assert found and all(line.split(":")[0].endswith((".wo.bias", ".w_down.bias")) for line in found)


def test_every_symbol_has_a_module_and_a_tp_plan():
    assert SUBLAYERS.keys() == tensor_parallel.TP_PLANS.keys() == LAYER_SYMBOLS.keys()


MLA_TRAIN = {"model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
             "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64", "data.seq_length": "32",
             "model.make_vocab_size_divisible_by": "128", "train.micro_batch_size": "2",
             "train.global_batch_size": "8", "train.train_iters": "3", "train.eval_interval": "0",
             "train.peak_flops": "1e11", "logger.progress_bar": "off", "scheduler.warmup_steps": "1",
             "checkpoint.save_at_end": "false", "optimizer.lr": "1e-3", **MODELS["mla"]}


@pytest.mark.parametrize("layout", [
    {"parallel.tp": "2"},
    pytest.param({"parallel.tp": "2", "parallel.sequence_parallel": "false", "parallel.loss_parallel": "false",
                  "model.q_lora_rank": "null", "model.softmax_type": "vanilla"}, marks=pytest.mark.slow)],
    ids=["tp2_sp_q_lora_sinks", "tp2_no_sp"])
def test_multi_latent_attention_under_tp2_trains_like_one_process(layout, tmp_path):
    """Losses of 3 steps and every parameter afterwards equal the one-process run within 1e-5 (the
    shared RoPE key k_r and the whole latent projections get the gradient of all heads)."""
    from meshtron.testing.parity import train_and_report
    from meshtron.training import Trainer

    model_options = {k: v for k, v in layout.items() if k.startswith("model.")}
    single = Trainer(load_config(overrides={**MLA_TRAIN, **model_options, "train.run_dir": str(tmp_path / "one")},
                                 world_size=1))
    losses = [r.loss for r in single.train()]
    overrides = {**MLA_TRAIN, **layout, "train.run_dir": str(tmp_path / "tp"), "parallel.timeout_s": "60"}
    for result in run_ranks(f"{train_and_report.__module__}:train_and_report", 2, timeout_s=240,
                            overrides=overrides):
        assert result["losses"] == pytest.approx(losses, abs=1e-5, rel=0)
        for name, p in single.model.named_parameters():
            torch.testing.assert_close(result["params"][name], p.detach(), atol=1e-5, rtol=0, msg=name)
