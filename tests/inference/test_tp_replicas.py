"""Several tensor-parallel groups in one world, each led by its own rank (issue 20): world 4 = two TP2
replicas from `ParallelDims` (dp_replicate 2 x tp 2), groups {0, 1} led by global rank 0 and {2, 3}
led by global rank 3 (its group's rank 1: the leader is named, not assumed to be rank 0). Each
leader serves its own prompts, with pings between steps and a suspend/resume, while its follower
replays its forwards; the greedy tokens equal a single-process engine's (slow). The fast test checks
the messages alone: each follower receives exactly its own leader's, in order."""

from __future__ import annotations

import time

import pytest

from meshtron.testing.multiprocess import rank_backend, rank_device_type, run_ranks
from tests.inference.helpers import RecordingRunner, save_tiny_checkpoint, workload

ENGINE = dict(num_blocks=128, block_size=4, max_num_batched_tokens=16)
LEADERS = (0, 1)  # the leader's rank within replica 0 and within replica 1 (global ranks 0 and 3)


def _replica(world_size: int):
    """(this rank's replica, its TPGroup for messages, the TP mesh) on the (dp_replicate 2, tp 2) mesh."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshtron.inference.tp_serving import message_group
    from meshtron.parallel.dims import ParallelDims

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=120))
    dims = ParallelDims(dp_replicate=2, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=world_size)
    mesh = dims.build_mesh(rank_device_type(), 120)
    replica = mesh["dp"].get_local_rank()
    return replica, message_group(mesh["tp"], 120, leader=LEADERS[replica]), mesh["tp"]


def messages_rank(rank: int, world_size: int):
    from meshtron.inference.tp_serving import Leader, follow

    replica, tp, _ = _replica(world_size)
    if not tp.is_leader:
        runner = RecordingRunner()
        follow(runner, tp)
        return runner.calls
    leader = Leader(tp, ping_s=0.05)
    for i in range(3):
        leader("step", [f"replica {replica} chunk {i}"])
        time.sleep(0.2 * (replica + 1))  # the two leaders interleave differently; pings in between
    leader("release")
    leader("stop")
    return "led"


def test_each_follower_hears_only_its_own_leader():
    results = run_ranks("tests.inference.test_tp_replicas:messages_rank", 4, timeout_s=120)
    assert results[0] == results[3] == "led"
    for follower, replica in ((1, 0), (2, 1)):
        assert results[follower] == [("step", [f"replica {replica} chunk {i}"]) for i in range(3)] + [("release", None)]


def _params(max_tokens):
    from meshtron.inference.request import SamplingParams

    return [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]


def replica_rank(rank: int, world_size: int, checkpoint: str, prompts, max_tokens):
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.inference.tp_serving import Leader, follow, lead

    replica, tp, tp_mesh = _replica(world_size)
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(device=rank_device_type(), **ENGINE), tp_mesh=tp_mesh)
    if not tp.is_leader:
        follow(engine.runner, tp)
        return ("followed", replica, tp.leader_global)
    lead(engine, Leader(tp, ping_s=0.05))
    time.sleep(0.3)  # idle: pings reach the follower before the first step
    mine = slice(replica * len(prompts) // 2, (replica + 1) * len(prompts) // 2)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[mine], _params(max_tokens[mine]))]
    finished = {}
    for step in range(6):
        finished.update({o.req_id: o for o in engine.step() if o.finished})
        if step == 3:
            engine.suspend()
            time.sleep(0.2)
            engine.resume()
    while engine.has_unfinished_requests():
        finished.update({o.req_id: o for o in engine.step() if o.finished})
    engine.shutdown()  # tells the follower to stop
    return ("led", replica, [finished[i].token_ids for i in ids])


@pytest.mark.slow
def test_two_tp2_replicas_with_their_own_leaders_equal_single_process(tmp_path):
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt")
    prompts, max_tokens = workload(num_requests=8, max_prompt=20, max_output=10)
    single = LLMEngine.from_checkpoint(checkpoint, EngineConfig(device="cpu", **ENGINE))
    expected = [o.token_ids for o in single.generate(prompts, _params(max_tokens))]
    results = run_ranks("tests.inference.test_tp_replicas:replica_rank", 4, timeout_s=300, checkpoint=checkpoint,
                        prompts=prompts, max_tokens=max_tokens)
    assert [r[:2] for r in results] == [("led", 0), ("followed", 0), ("followed", 1), ("led", 1)]
    assert results[1][2] == 0 and results[2][2] == 3  # each follower heard its own replica's leader
    assert results[0][2] == expected[:4]
    assert results[3][2] == expected[4:]
