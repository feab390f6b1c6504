"""Tensor-parallel inference (the training TP plans, two ranks: gloo, or NCCL under
MESHTRON_TEST_BACKEND=nccl) gives the single-process
greedy tokens: every rank running the same engine (SPMD), and rank 0 leading with the other rank
following its broadcast steps (how `meshtron serve` runs under torchrun), across a suspend/resume."""

from __future__ import annotations

import pytest

from meshtron.testing.multiprocess import rank_backend, rank_device_type, run_ranks
from tests.inference.helpers import save_tiny_checkpoint, workload

ENGINE = dict(num_blocks=128, block_size=4, max_num_batched_tokens=16)


def _setup(world_size: int, checkpoint: str):
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=120))
    mesh = init_device_mesh(rank_device_type(), (world_size,), mesh_dim_names=("tp",))
    return LLMEngine.from_checkpoint(checkpoint, EngineConfig(device=rank_device_type(), **ENGINE), tp_mesh=mesh)


def _params(max_tokens):
    from meshtron.inference.request import SamplingParams

    return [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]


def spmd_rank(rank: int, world_size: int, checkpoint: str, prompts, max_tokens):
    engine = _setup(world_size, checkpoint)
    local_heads = engine.runner.model.layers[0].mixer.wq.weight.to_local().shape[0]
    return [o.token_ids for o in engine.generate(prompts, _params(max_tokens))], local_heads


def leader_follower_rank(rank: int, world_size: int, checkpoint: str, prompts, max_tokens):
    from datetime import timedelta

    import torch.distributed as dist

    from meshtron.inference.tp_serving import Leader, follow, lead

    engine = _setup(world_size, checkpoint)
    # test-backend: gloo by design, as `meshtron serve` makes it: the leader's step objects travel on the CPU
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    if rank != 0:
        follow(engine.runner, group)
        return None
    lead(engine, Leader(group))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, _params(max_tokens))]
    finished = {}
    for step in range(8):
        finished.update({o.req_id: o for o in engine.step() if o.finished})
        if step == 3:
            engine.suspend()
            engine.resume()
    while engine.has_unfinished_requests():
        finished.update({o.req_id: o for o in engine.step() if o.finished})
    engine.shutdown()  # tells the follower to stop
    return [finished[i].token_ids for i in ids]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine

    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt")
    prompts, max_tokens = workload(num_requests=8, max_prompt=20, max_output=10)
    single = LLMEngine.from_checkpoint(checkpoint, EngineConfig(device="cpu", **ENGINE))
    expected = [o.token_ids for o in single.generate(prompts, _params(max_tokens))]
    full_heads = single.runner.model.layers[0].mixer.wq.weight.shape[0]
    return checkpoint, prompts, max_tokens, expected, full_heads


def test_tp2_equals_single_process(setup):
    checkpoint, prompts, max_tokens, expected, full_heads = setup
    results = run_ranks("tests.inference.test_tp:spmd_rank", 2, timeout_s=240, checkpoint=checkpoint,
                        prompts=prompts, max_tokens=max_tokens)
    for tokens, local_heads in results:
        assert local_heads == full_heads // 2  # really sharded
        assert tokens == expected


def test_tp2_leader_and_follower_equal_single_process(setup):
    checkpoint, prompts, max_tokens, expected, _ = setup
    results = run_ranks("tests.inference.test_tp:leader_follower_rank", 2, timeout_s=240, checkpoint=checkpoint,
                        prompts=prompts, max_tokens=max_tokens)
    assert results[0] == expected and results[1] is None
