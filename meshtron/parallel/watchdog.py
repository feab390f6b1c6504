"""Hang-proofing for multi-process runs: heartbeats, stack dumps, and naming the ranks that did not
arrive at a collective.

Every rank publishes where it is in the process group's key-value store: the activity (training
step, evaluation, checkpoint save, straggler report), its step, the phase inside it (forward or
backward of micro-batch i, optimizer, communication) and a beat counter. The training thread only
records it in memory; the watchdog's thread writes it to the store when it changed (every poll), so
the step pays no store round trip per phase. When a collective fails or
times out (`parallel.timeout_s`) on a rank, that rank writes its stack to
`<run_dir>/stacks/rank<N>.txt`, records its own failure in the store, waits a short grace period for
the other waiting ranks to record theirs, and names the ranks that did not (with where each was last
seen): those are the ranks that never reached the collective. It then raises an abort flag holding
that message. A background thread on every rank polls the flag and, when it is set, prints one line
naming the activity, step and ranks, dumps all its threads' stacks (the main thread shows where the
rank was stuck) and exits, so no rank is left hanging.

Backstop: inside a training step, a rank that makes no progress (no phase change) for twice the
timeout is stuck outside collectives; it names itself, raises the flag and exits. The backstop is
paused outside training steps: evaluation and checkpoint saves may legitimately take longer than
the timeout between two collectives; their collectives are still covered by the timeout.
SIGUSR1 dumps the stack on demand; SIGTERM (sent by torchrun when another rank dies) dumps it before
the process ends.

Under NCCL a collective does not block the training thread: it is queued on the GPU, and when it
times out NCCL's own watchdog ends the process (after dumping its flight recorder, see
parallel/distributed.py), so the report above never runs. There the watchdog also makes an early
report (`report_after_s`, half the timeout): once a rank has made no progress that long inside an
activity, it prints and writes every rank's last position and the ranks behind the others, and dumps
its stack, without ending anything.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from meshtron.compat import default_store
from meshtron.parallel.distributed import group_device

ABORT_KEY = "meshtron/abort"
EXIT_CODE = 3
IDLE = "between activities"


def _heartbeat_key(rank: int) -> str:
    return f"meshtron/heartbeat/{rank}"


def _failed_key(rank: int) -> str:
    return f"meshtron/failed/{rank}"


@dataclass(frozen=True)
class Position:
    """Where a rank is: `activity` ("training step", "evaluation after step", "checkpoint save at
    step", "straggler report at step", "stop-signal check after step", or IDLE) at `step`, in `phase`, after `beats` phase changes in the activity."""
    activity: str
    step: int
    phase: str
    beats: int

    def encode(self) -> str:
        return f"{self.step}|{self.beats}|{self.activity}|{self.phase}"

    @staticmethod
    def decode(text: str) -> Position:
        step, beats, activity, phase = text.split("|", 3)
        return Position(activity, int(step), phase, int(beats))

    def describe(self) -> str:
        if self.activity == IDLE:
            return f"{IDLE} ({self.phase})"
        return f"{self.activity} {self.step}, phase {self.phase}"


# the trainer's activities in the order they happen within one step number
ACTIVITY_ORDER = ("training step", "straggler report at step", "evaluation after step", "checkpoint save at step",
                  "stop-signal check after step")


def progress(p: Position) -> tuple[int, int, int, int]:
    """How far a rank has come: (step, activity within the step, inside (0) or after (1) it, phase changes)."""
    if p.activity == IDLE:  # "after <activity> <step>", or "before the first step"
        done = [i for i, name in enumerate(ACTIVITY_ORDER) if p.phase.startswith(f"after {name} ")]
        return (p.step, done[0], 1, 0) if done else (p.step, -1, 1, 0)
    order = ACTIVITY_ORDER.index(p.activity) if p.activity in ACTIVITY_ORDER else len(ACTIVITY_ORDER)
    return p.step, order, 0, p.beats


def behind(seen: dict[int, Optional[Position]]) -> list[int]:
    """Ranks behind the furthest one: never reported, or less far (an earlier step or activity, or
    fewer phase changes in the same one). Ranks waiting at the same collective are equally far."""
    known = {r: progress(p) for r, p in seen.items() if p is not None}
    furthest = max(known.values(), default=None)
    return sorted(r for r in seen if r not in known or known[r] < furthest)


class Watchdog:
    def __init__(self, run_dir: Path, timeout_s: float, poll_s: float = 0.5, report_after_s: Optional[float] = None):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s, self.poll_s = timeout_s, poll_s
        # how long a failed rank waits for the other waiting ranks to report before naming the rest;
        # under half the timeout so that the named rank's own backstop (2x timeout) fires later
        self.grace_s = min(timeout_s / 2, 5.0)
        self.stack_dir = Path(run_dir) / "stacks"
        self.stack_dir.mkdir(parents=True, exist_ok=True)
        self.store = default_store()
        self._stack_file = open(self.stack_dir / f"rank{self.rank}.txt", "w")
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)
        faulthandler.register(signal.SIGTERM, file=self._stack_file, all_threads=True, chain=True)
        self.position = Position(IDLE, 0, "before the first step", 0)
        self._progress_at = time.monotonic()
        self._backstop = False  # armed inside training steps only
        self._raised = False
        self.report_after_s = report_after_s
        self._reported: Optional[Position] = None  # the position the early report was made in
        self._published: Optional[Position] = None
        self._publish()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshtron-watchdog", daemon=True)
        self._thread.start()

    # ---- heartbeats ---------------------------------------------------------------------------

    def _publish(self) -> None:
        """Write this rank's position to the store if it changed (from the watchdog's thread)."""
        position = self.position
        if position is self._published:
            return
        try:
            self.store.set(_heartbeat_key(self.rank), position.encode())
            self._published = position
        except Exception:  # the store's host (rank 0) is gone: collectives will fail and say so
            pass

    @contextmanager
    def activity(self, name: str, step: int, backstop: bool = False) -> Iterator[None]:
        """Track an activity that runs collectives (its own step number; phases via `beat`)."""
        self.position = Position(name, step, "start", 0)
        self._progress_at = time.monotonic()
        self._backstop = backstop
        try:
            yield
        finally:
            self._backstop = False
            self.position = Position(IDLE, step, f"after {name} {step}", 0)

    def beat(self, phase: str) -> None:
        """The current activity moved on to `phase` (e.g. "forward of micro-batch 0")."""
        p = self.position
        self.position = Position(p.activity, p.step, phase, p.beats + 1)
        self._progress_at = time.monotonic()

    def heartbeats(self) -> dict[int, Optional[Position]]:
        """Where each rank was last seen (None if it never reported)."""
        seen: dict[int, Optional[Position]] = {}
        for r in range(self.world_size):
            key = _heartbeat_key(r)
            seen[r] = Position.decode(self.store.get(key).decode()) if self.store.check([key]) else None
        return seen

    def lagging_ranks(self, step: int) -> list[int]:
        """Ranks whose last reported step is before `step`."""
        return [r for r, p in self.heartbeats().items() if p is None or p.step < step]

    # ---- failures -------------------------------------------------------------------------------

    def dump_stack(self, reason: str) -> None:
        self._stack_file.write(f"--- rank {self.rank}: {reason} ---\n")
        self._stack_file.flush()
        faulthandler.dump_traceback(file=self._stack_file, all_threads=True)
        self._stack_file.flush()

    def _missing_ranks(self) -> list[int]:
        """Wait up to grace_s for every other rank to report a failed collective; return those that did not."""
        deadline = time.monotonic() + self.grace_s
        while True:
            missing = [r for r in range(self.world_size)
                       if r != self.rank and not self.store.check([_failed_key(r)])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)

    def collective_failed(self, error: BaseException) -> str:
        """Called on a rank whose collective failed: dump, name the ranks that never arrived, tell the
        others, return the message."""
        where = self.position
        first_line = str(error).splitlines()[0] if str(error) else repr(error)
        self.dump_stack(f"collective failed in {where.describe()}: {first_line}")
        try:
            self._raised = True
            self._publish()
            self.store.set(_failed_key(self.rank), where.encode())
            missing = self._missing_ranks()
            seen = self.heartbeats()
        except Exception:  # the store may be gone if rank 0 died; say what is known
            missing, seen = [], {}
        if missing:
            last = "; ".join(f"rank {r} was last in " + (seen[r].describe() if seen.get(r) else "no step (never reported)")
                             for r in missing)
            who = f"rank(s) {missing} did not arrive ({last})"
        else:
            who = "every rank reached a collective (a rank may have died, or the collectives do not match)"
        message = (f"a collective in {where.describe()} failed or timed out after {self.timeout_s:g}s on rank "
                   f"{self.rank}: {who}; stacks of every rank are in {self.stack_dir}")
        self._raised = True  # this rank reports the failure itself: its watcher must not end it
        try:
            if not self.store.check([ABORT_KEY]):
                self.store.set(ABORT_KEY, message)
        except Exception:
            pass
        # let every watcher read the flag before this rank, perhaps the store's host, goes away
        time.sleep(2 * self.poll_s + 0.1)
        return message

    def _exit(self, line: str, reason: str) -> None:
        print(line, file=sys.stderr, flush=True)
        self._stack_file.write(line + "\n")
        self.dump_stack(reason)
        self._stack_file.close()
        os._exit(EXIT_CODE)

    def report_stall(self, stalled: float) -> str:
        """The early report: every rank's last position and the ranks behind; printed, written with this
        rank's stack to its stack file, and returned. Ends nothing."""
        where = self.position
        self._reported = where
        try:
            seen = self.heartbeats()
            late = behind(seen)
            who = (f"rank(s) {late} are behind the others" if late else
                   "no rank is behind the others (a rank may have died, or the collectives do not match)")
        except Exception:  # the store lives on rank 0
            seen, who = {}, "the key-value store is unreachable (rank 0 may have ended)"
        every = "; ".join(f"rank {r}: " + (p.describe() if p else "never reported") for r, p in sorted(seen.items()))
        line = (f"meshtron watchdog: rank {self.rank} made no progress for {stalled:.0f}s in {where.describe()}: "
                f"{who}. Last seen: {every}. (A report only: under NCCL its watchdog ends the run at "
                f"parallel.timeout_s={self.timeout_s:g}s and dumps its flight recorder.)")
        print(line, file=sys.stderr, flush=True)
        self._stack_file.write(line + "\n")
        self.dump_stack(f"no progress for {stalled:.0f}s in {where.describe()}")
        return line

    def _watch(self) -> None:
        store_lost_at: Optional[float] = None
        while not self._stop.wait(self.poll_s):
            self._publish()
            try:
                aborted = self.store.check([ABORT_KEY])
                message = self.store.get(ABORT_KEY).decode() if aborted else ""
                store_lost_at = None
            except Exception:
                # the store's host (rank 0) is gone: at the normal end of a run this rank closes its
                # watchdog within moments; still running a timeout later, the run died elsewhere
                aborted, message = False, ""
                store_lost_at = store_lost_at or time.monotonic()
                if time.monotonic() - store_lost_at > self.timeout_s:
                    aborted, message = True, "the key-value store on rank 0 is unreachable (rank 0 has ended)"
            if aborted and not self._raised:
                self._exit(f"meshtron watchdog: rank {self.rank} (in {self.position.describe()}) exits because the "
                           f"run was aborted: {message}", "run aborted by another rank")
            stalled = time.monotonic() - self._progress_at
            position = self.position
            if (self.report_after_s is not None and not self._raised and position.activity != IDLE
                    and stalled > self.report_after_s and self._reported is not position):
                self.report_stall(stalled)
            if self._backstop and not self._raised and stalled > 2 * self.timeout_s:
                where = self.position.describe()
                message = (f"rank {self.rank} made no progress for {stalled:.0f}s (> 2 x parallel.timeout_s) in "
                           f"{where}, outside any collective; stacks of every rank are in {self.stack_dir}")
                try:
                    self.store.set(ABORT_KEY, message)
                except Exception:
                    pass
                self._exit(f"meshtron watchdog: {message}", f"stuck outside collectives in {where}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll_s)
        faulthandler.unregister(signal.SIGUSR1)
        faulthandler.unregister(signal.SIGTERM)
        self._stack_file.close()


def step_time_extremes(seconds: float, group=None) -> tuple[tuple[int, float], tuple[int, float]]:
    """All-gather one step time per rank (on the group's device); return (slowest rank, time), (fastest rank, time)."""
    device = group_device(group)
    times = torch.zeros(dist.get_world_size(group), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(times, torch.tensor([seconds], dtype=torch.float64, device=device), group=group)
    times = times.cpu()
    slow, fast = int(times.argmax()), int(times.argmin())
    return (slow, float(times[slow])), (fast, float(times[fast]))
