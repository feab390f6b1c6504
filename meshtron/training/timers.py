"""Wall-clock timers for start-up phases and per-step phases.

Per-step averages leave out the first step (it pays for allocation, warm-up and lazy init).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timers:
    def __init__(self, annotate: Optional[Callable[[str], Any]] = None) -> None:
        """`annotate(name)`, if given, is a context manager entered around each step phase (profiler ranges)."""
        self.annotate = annotate
        self.startup: dict[str, float] = {}
        self._step_totals: dict[str, float] = defaultdict(float)
        self._step_counts: dict[str, int] = defaultdict(int)
        self._current: dict[str, float] = {}

    @contextmanager
    def startup_phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.startup[name] = time.perf_counter() - t0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one phase of the current step (data, forward_backward, optimizer, ...)."""
        t0 = time.perf_counter()
        with self.annotate(name) if self.annotate is not None else nullcontext():
            yield
        _sync()
        self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - t0

    def end_step(self, step_index: int) -> dict[str, float]:
        """Close a step; return its phase times. Step 0 is not added to the averages."""
        current, self._current = self._current, {}
        if step_index > 0:
            for k, v in current.items():
                self._step_totals[k] += v
                self._step_counts[k] += 1
        return current

    def averages(self) -> dict[str, float]:
        return {k: self._step_totals[k] / self._step_counts[k] for k in self._step_totals}
