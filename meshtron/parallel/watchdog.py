"""Hang-proofing for multi-process runs: heartbeats, stack dumps, and naming the ranks that did not
arrive at a collective.

Every rank publishes the step it is on in the process group's key-value store. When a collective
times out (`parallel.timeout_s`) on a rank that was waiting, that rank reads the heartbeats to
name the ranks behind it, writes its own stack to `<run_dir>/stacks/rank<N>.txt`, and raises an
abort flag in the store. A background thread on every rank polls that flag and, when it is set (or
when its own step has run past twice the timeout), dumps all its threads' stacks — the main thread
shows where the rank was stuck — and exits, so no rank is left hanging. SIGUSR1 dumps the stack on
demand; SIGTERM (sent by torchrun when another rank dies) dumps it before the process ends.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

ABORT_KEY = "meshtron/abort"


def _heartbeat_key(rank: int) -> str:
    return f"meshtron/heartbeat/{rank}"


class Watchdog:
    def __init__(self, run_dir: Path, timeout_s: float, poll_s: float = 0.5):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.stack_dir = Path(run_dir) / "stacks"
        self.stack_dir.mkdir(parents=True, exist_ok=True)
        self.store = dist.distributed_c10d._get_default_store()
        self._stack_file = open(self.stack_dir / f"rank{self.rank}.txt", "w")
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)
        faulthandler.register(signal.SIGTERM, file=self._stack_file, all_threads=True, chain=True)
        self._step_started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshtron-watchdog", daemon=True)
        self._thread.start()

    def step_started(self, step: int) -> None:
        self._step_started = time.monotonic()
        self.store.set(_heartbeat_key(self.rank), str(step))

    def heartbeats(self) -> dict[int, Optional[int]]:
        """The last step each rank started (None if it never reported)."""
        seen: dict[int, Optional[int]] = {}
        for r in range(self.world_size):
            key = _heartbeat_key(r)
            seen[r] = int(self.store.get(key).decode()) if self.store.check([key]) else None
        return seen

    def lagging_ranks(self, step: int) -> list[int]:
        return [r for r, s in self.heartbeats().items() if s is None or s < step]

    def dump_stack(self, reason: str) -> None:
        self._stack_file.write(f"--- rank {self.rank}: {reason} ---\n")
        self._stack_file.flush()
        faulthandler.dump_traceback(file=self._stack_file, all_threads=True)
        self._stack_file.flush()

    def collective_failed(self, step: int, error: BaseException) -> str:
        """Called on the rank whose collective failed: dump, tell the others, return the message."""
        lagging = [r for r in self.lagging_ranks(step) if r != self.rank]
        self.dump_stack(f"collective failed at step {step}: {str(error).splitlines()[0] if str(error) else error!r}")
        who = f"rank(s) {lagging} did not arrive" if lagging else "every rank had reached this step"
        message = (f"a collective at step {step} failed or timed out after {self.timeout_s:g}s on rank {self.rank}: "
                   f"{who}; stacks of every rank are in {self.stack_dir}")
        try:
            self.store.set(ABORT_KEY, message)
        except Exception:  # the store may be gone if rank 0 died; the message still stands
            pass
        return message

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                aborted = self.store.check([ABORT_KEY])
            except Exception:
                aborted = True  # the store's host is gone: the run is over
            overdue = time.monotonic() - self._step_started > 2 * self.timeout_s
            if aborted or overdue:
                self.dump_stack("run aborted by another rank" if aborted else "step overdue: stuck outside collectives")
                self._stack_file.close()
                os._exit(3)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll_s)
        faulthandler.unregister(signal.SIGUSR1)
        faulthandler.unregister(signal.SIGTERM)
        self._stack_file.close()


def step_time_extremes(seconds: float, group=None) -> tuple[tuple[int, float], tuple[int, float]]:
    """All-gather one step time per rank; return (slowest rank, time), (fastest rank, time)."""
    times = torch.zeros(dist.get_world_size(group), dtype=torch.float64)
    dist.all_gather_into_tensor(times, torch.tensor([seconds], dtype=torch.float64), group=group)
    slow, fast = int(times.argmax()), int(times.argmin())
    return (slow, float(times[slow])), (fast, float(times[fast]))
