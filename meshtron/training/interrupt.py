"""Stopping a run on SIGTERM (a scheduler's preemption or time limit) or SIGINT (Ctrl-C): the handler
only records the signal; the loop checks at each step boundary, every rank agreeing through one
all-reduce (a rank that got the signal later still stops at the same step), saves a checkpoint and
raises `RunInterrupted`, which the command line turns into exit code 128 + signal (143, 130).
A second signal of the same kind acts at once (the handler it replaced is back)."""

from __future__ import annotations

import signal
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


class RunInterrupted(Exception):
    """The run stopped on a signal after saving a checkpoint; `exit_code` is what a scheduler expects."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class StopOnSignal:
    """Context manager: while inside, SIGTERM and SIGINT set `signum` instead of ending the process.
    Only the main thread can install handlers; elsewhere (a trainer run from a thread) it does nothing."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # a second signal acts at once

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in EXIT_CODES:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def agreed(self, device: torch.device) -> Optional[int]:
        """The signal every rank stops for (the largest number any rank received), or None to go on.
        A collective under several processes: every rank calls it at the same step boundary."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signum
        flag = torch.tensor([self.signum or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
