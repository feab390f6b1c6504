"""Profiling: a torch.profiler trace of chosen optimizer steps, and named ranges around the phases
of a step (forward, backward, optimizer, communication).

A range is a `torch.profiler.record_function` (it shows in the trace; nearly free when no profiler
runs) and, with `profile.nvtx` on CUDA, an NVTX range too (for Nsight Systems). `profile.steps:
a:b` starts the profiler before step a and stops it after step b-1, writing
`trace_rank{R}_steps{a}-{b-1}.json` (open in Perfetto or chrome://tracing) and a table of the
most expensive operators, `summary_rank{R}_steps{a}-{b-1}.txt`, under `profile.dir`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from meshtron.config.schema import ProfileConfig


class Ranges:
    """`with ranges("forward"): ...` marks a phase for the profiler and, when enabled on CUDA, NVTX."""

    def __init__(self, nvtx: bool = False):
        self.nvtx = nvtx and torch.cuda.is_available()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        with record_function(name):
            if self.nvtx:
                torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                if self.nvtx:
                    torch.cuda.nvtx.range_pop()


class StepProfiler:
    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int = 0):
        self.window = cfg.step_range()
        self.cfg, self.rank = cfg, rank
        self.out_dir = Path(cfg.dir) if cfg.dir else Path(run_dir) / "profile"
        self._profiler: Optional[profile] = None
        self.written: list[Path] = []

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap optimizer step `step` (1-based): the profiler runs over the configured window."""
        if self.window is None or not self.window[0] <= step < self.window[1]:
            yield
            return
        if self._profiler is None:
            self._start()
        with record_function(f"ProfilerStep#{step}"):
            yield
        if step == self.window[1] - 1:
            self.close()

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profiler = profile(activities=activities, record_shapes=self.cfg.record_shapes,
                                 profile_memory=self.cfg.profile_memory, with_stack=self.cfg.with_stack)
        self._profiler.__enter__()

    def close(self) -> None:
        """Stop a running profiler and write its trace (also when training ends inside the window)."""
        if self._profiler is None:
            return
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        first, end = self.window
        name = f"rank{self.rank}_steps{first}-{end - 1}"
        trace = self.out_dir / f"trace_{name}.json"
        prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        summary = self.out_dir / f"summary_{name}.txt"
        summary.write_text(prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
        self.written += [trace, summary]
