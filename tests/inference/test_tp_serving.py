"""TP serving when idle (issue 18, finding 11): followers wait for the leader's next request for longer
than the group's timeout (the leader pings), and still run it; a leader that dies is noticed within
the timeout. 2 ranks, a 2 s timeout, 6 s idle; the leader's objects travel on a gloo group, as in
`meshtron serve`, whatever the default group's backend (MESHTRON_TEST_BACKEND)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from meshtron.testing.multiprocess import RankError, rank_backend, run_ranks
from tests.inference.helpers import RecordingRunner


def idle_then_serve(rank: int, world_size: int, idle_s: float, group_timeout_s: float, ping: bool, leader_dies: bool):
    import os

    import torch.distributed as dist

    from meshtron.inference.tp_serving import Leader, follow

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=group_timeout_s))
    # test-backend: gloo by design, as `meshtron serve` makes it: the leader's step objects travel on the CPU
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=group_timeout_s))
    if rank != 0:
        runner = RecordingRunner()
        follow(runner, group)
        return runner.calls
    leader = Leader(group, ping_s=group_timeout_s / 4 if ping else None)
    time.sleep(idle_s)  # no request for longer than the timeout
    if leader_dies:
        os._exit(0)
    leader("step", ["chunk"])
    leader("release")
    leader("stop")
    return "served"


def test_idle_followers_wait_for_the_next_request():
    leader, follower = run_ranks("tests.inference.test_tp_serving:idle_then_serve", 2, timeout_s=60,
                                 idle_s=6.0, group_timeout_s=2.0, ping=True, leader_dies=False)
    assert leader == "served"
    assert follower == [("step", ["chunk"]), ("release", None)]


@pytest.mark.parametrize("ping", [False, True], ids=["no_pings", "leader_died"])
def test_followers_give_up_on_a_silent_leader(ping):
    """Without pings (the old leader) an idle follower failed at the timeout; with them it fails only when
    the leader is gone, and then within the timeout rather than hanging."""
    results = run_ranks("tests.inference.test_tp_serving:idle_then_serve", 2, timeout_s=60, allow_failures=True,
                        idle_s=4.0 if ping else 6.0, group_timeout_s=2.0, ping=ping, leader_dies=ping)
    assert isinstance(results[1], RankError)
    # ended by the group's timeout or the closed connection, not killed by the launcher's timeout
    assert "timed out" in results[1].lower() or "connection" in results[1].lower(), results[1]
