"""A rank that never joins a collective makes the run fail within the timeout, naming that rank,
with every rank's stack dumped — instead of hanging."""

from __future__ import annotations

import time

from meshtron.testing.multiprocess import RankError, run_ranks

from .test_layouts import BASE


def test_hung_rank_is_named_and_stacks_dumped(tmp_path):
    run_dir = tmp_path / "run"
    overrides = {**BASE, "parallel.dp_shard": "2", "train.run_dir": str(run_dir), "parallel.timeout_s": "5",
                 "train.train_iters": "4"}
    t0 = time.monotonic()
    results = run_ranks("meshtron.testing.parity:hang_one_rank", 2, timeout_s=120, allow_failures=True,
                        overrides=overrides, hang_rank=1, hang_step=2)
    elapsed = time.monotonic() - t0
    assert elapsed < 100  # far below the launcher's kill timeout: the run ended by itself
    waiting, stuck = results
    assert isinstance(stuck, RankError)  # the stuck rank was ended by its watchdog
    assert "a collective at step 2 failed or timed out" in waiting and "rank(s) [1] did not arrive" in waiting
    dumps = {p.name: p.read_text() for p in (run_dir / "stacks").iterdir()}
    assert set(dumps) == {"rank0.txt", "rank1.txt"}
    assert "collective failed at step 2" in dumps["rank0.txt"]
    assert "run aborted by another rank" in dumps["rank1.txt"] and "in stuck" in dumps["rank1.txt"]
