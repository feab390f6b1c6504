"""The watchdog's side of hangs under NCCL (issue 18, finding 10), on 2 ranks (gloo, or NCCL under
MESHTRON_TEST_BACKEND=nccl): heartbeats cost the training thread no store round trip (its own thread
publishes them), and the early report — made while NCCL's watchdog would still be waiting, since at
its timeout NCCL ends the process before the trainer's report can run — names the rank behind the
others and where every rank was."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from meshtron.testing.multiprocess import rank_backend, run_ranks


class _RecordingStore:
    """The real store, noting which thread wrote each heartbeat."""

    def __init__(self, store):
        self.store, self.writers = store, []

    def set(self, key, value):
        if "heartbeat" in key:
            self.writers.append(threading.current_thread().name)
        return self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


def stalled_rank(rank: int, world_size: int, run_dir: str) -> dict:
    """Both ranks enter step 1; rank 0 moves on three phases, rank 1 stays in its first; then both
    wait past `report_after_s` inside the step."""
    import torch.distributed as dist

    from meshtron.parallel.watchdog import Watchdog

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=60))
    watchdog = Watchdog(run_dir, timeout_s=30, poll_s=0.1, report_after_s=1.0)
    watchdog.store = store = _RecordingStore(watchdog.store)
    with watchdog.activity("training step", 1):
        phases = ["forward of micro-batch 0"] + (["backward of micro-batch 0", "communication"] if rank == 0 else [])
        for phase in phases:
            watchdog.beat(phase)
        time.sleep(2.5)  # > report_after_s: each rank reports once; nothing ends
        dist.barrier()
        seen = {r: p.describe() for r, p in watchdog.heartbeats().items()}
        dist.barrier()  # both read before either leaves the step
    watchdog.close()
    return {"writers": store.writers, "seen": seen, "stacks": (watchdog.stack_dir / f"rank{rank}.txt").read_text()}


def test_early_report_names_the_rank_behind_and_heartbeats_leave_the_training_thread(tmp_path):
    ranks = run_ranks("tests.parallel.test_watchdog_nccl:stalled_rank", 2, timeout_s=120, run_dir=str(tmp_path))
    for rank, out in enumerate(ranks):
        assert out["writers"] and set(out["writers"]) == {"meshtron-watchdog"}, out["writers"]
        assert out["seen"] == {0: "training step 1, phase communication",
                               1: "training step 1, phase forward of micro-batch 0"}
        report = out["stacks"].splitlines()[0]
        assert report.startswith(f"meshtron watchdog: rank {rank} made no progress for ")
        assert "rank(s) [1] are behind the others" in report
        assert ("Last seen: rank 0: training step 1, phase communication; "
                "rank 1: training step 1, phase forward of micro-batch 0.") in report
        assert out["stacks"].count("made no progress") == 1  # once per position, not every poll
        assert "in stalled_rank" in out["stacks"]  # and its stack


def test_behind_orders_ranks_by_step_activity_and_phase():
    from meshtron.parallel.watchdog import IDLE, Position, behind

    def at(activity: str, step: int, beats: int = 0) -> Position:
        return Position(activity, step, "p", beats)

    def after(activity: str, step: int) -> Position:
        return Position(IDLE, step, f"after {activity} {step}", 0)

    assert behind({0: at("training step", 2, 5), 1: at("training step", 2, 5)}) == []  # waiting at one collective
    assert behind({0: at("training step", 2, 5), 1: at("training step", 2, 3), 2: at("training step", 2, 5)}) == [1]
    assert behind({0: at("training step", 3, 1), 1: after("training step", 2)}) == [1]
    assert behind({0: after("training step", 3), 1: at("training step", 3, 9)}) == [1]  # 0 finished the step
    assert behind({0: at("evaluation after step", 3, 1), 1: after("training step", 3)}) == [1]
    assert behind({0: at("training step", 1, 2), 1: Position(IDLE, 0, "before the first step", 0)}) == [1]
    assert behind({0: at("training step", 3, 1), 1: None}) == [1]  # never reported
