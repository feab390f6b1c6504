"""The forked-rank harness: results in rank order, Python errors reported at once, and a native crash
(here os.abort, SIGABRT as glibc's heap checks raise it) repeated once with a warning that carries
faulthandler's stack of the crashed rank."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from meshtron.testing.multiprocess import RankFailure, run_ranks


def _count_attempt(counter: str, rank: int) -> int:
    """Record one attempt of `rank` in the file `counter`; return how many rank 0 made so far."""
    with open(counter, "a") as f:
        f.write(f"{rank}\n")
    return Path(counter).read_text().split().count("0")


def _abort() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file, whatever the machine's limit
    os.abort()


def square_rank(rank: int, world_size: int, counter: str) -> int:
    _count_attempt(counter, rank)
    return rank * rank + world_size


def abort_first_attempt(rank: int, world_size: int, counter: str) -> int:
    if _count_attempt(counter, rank) == 1 and rank == 0:
        _abort()
    return rank


def always_abort(rank: int, world_size: int, counter: str) -> int:
    _count_attempt(counter, rank)
    if rank == 1:
        _abort()
    return rank


def raise_error(rank: int, world_size: int, counter: str) -> int:
    _count_attempt(counter, rank)
    raise ValueError(f"rank {rank} refuses")


def attempts(counter: Path) -> int:
    return counter.read_text().split().count("0")


def test_results_in_rank_order(tmp_path):
    counter = tmp_path / "n"
    assert run_ranks("tests.parallel.test_harness:square_rank", 3, timeout_s=60, counter=str(counter)) == [3, 4, 7]
    assert attempts(counter) == 1


def test_a_native_crash_is_run_once_more_with_a_warning(tmp_path):
    counter = tmp_path / "n"
    with pytest.warns(RuntimeWarning, match=r"rank 0 died of SIGABRT(.|\n)*Fatal Python error: Aborted"):
        results = run_ranks("tests.parallel.test_harness:abort_first_attempt", 2, timeout_s=60, counter=str(counter))
    assert results == [0, 1]
    assert attempts(counter) == 2


def test_a_second_native_crash_fails(tmp_path):
    counter = tmp_path / "n"
    with pytest.warns(RuntimeWarning), pytest.raises(RankFailure, match="crashed natively twice(.|\n)*rank 1 died of SIGABRT"):
        run_ranks("tests.parallel.test_harness:always_abort", 2, timeout_s=60, counter=str(counter))
    assert attempts(counter) == 2


def test_a_python_error_is_not_repeated(tmp_path):
    counter = tmp_path / "n"
    with pytest.raises(RankFailure, match="ValueError: rank 0 refuses"):
        run_ranks("tests.parallel.test_harness:raise_error", 2, timeout_s=60, counter=str(counter))
    assert attempts(counter) == 1
