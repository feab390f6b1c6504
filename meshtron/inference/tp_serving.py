"""Tensor-parallel serving: rank 0 of the TP mesh runs the whole engine (HTTP, scheduler, KV block
accounting, sampling); every other rank follows, running the same sharded forward on each step's
chunks, which rank 0 broadcasts before its own forward. Keys/values stay sharded by head on every
rank; only the step's plain `ScheduledChunk`s (token ids, positions, block tables) travel.
Messages: ("step", chunks), ("release", None) on suspend, ("stop", None) on shutdown, and ("ping", None)
whenever the leader has sent nothing for `ping_s` (a quarter of the timeout): a follower's wait is a
broadcast with the group's timeout, so without pings an idle server lost its followers after
`timeout_s` (10 minutes) and then hung in its next request's all-reduce. A follower still notices a
leader that died, within the timeout.

    torchrun --nproc-per-node 2 -m meshtron serve --checkpoint DIR --port 8000
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from meshtron.inference.config import EngineConfig
from meshtron.inference.engine import LLMEngine
from meshtron.inference.runner import ModelRunner

LEADER = 0


def broadcast(kind: str, payload: Any = None, group=None) -> None:
    dist.broadcast_object_list([(kind, payload)], src=LEADER, group=group)


class Leader:
    """The engine's step hook on rank 0: forwards each message to the followers; 'stop' only once
    (after it the followers are gone and a broadcast would wait forever). With `ping_s`, a thread
    sends ("ping", None) whenever nothing was sent for that long; a lock keeps its broadcasts and the
    engine's in one order on the group."""

    def __init__(self, group=None, ping_s: Optional[float] = None):
        self.group, self.stopped = group, False
        self._lock = threading.Lock()
        self._sent_at = time.monotonic()
        self._done = threading.Event()
        if ping_s is not None:
            threading.Thread(target=self._ping, args=(ping_s,), name="meshtron-tp-ping", daemon=True).start()

    def __call__(self, kind: str, payload: Any = None) -> None:
        with self._lock:
            if self.stopped:
                return
            broadcast(kind, payload, self.group)
            self._sent_at = time.monotonic()
            self.stopped = kind == "stop"
        if self.stopped:
            self._done.set()

    def _ping(self, every: float) -> None:
        while not self._done.wait(every / 4):
            if time.monotonic() - self._sent_at >= every:
                try:
                    self("ping")
                except Exception:  # a follower is gone: the engine's next broadcast raises and says so
                    return


def lead(engine: LLMEngine, leader: Leader) -> LLMEngine:
    """Make `engine` (on rank 0) announce every forward, suspend and shutdown to the followers."""
    engine.step_hook = leader
    return engine


def follow(runner: ModelRunner, group=None) -> None:
    """Run the leader's forwards until it stops (ranks > 0)."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=LEADER, group=group)
        kind, payload = message[0]
        if kind == "step":
            runner.forward_only(payload)
        elif kind == "release":
            runner.release()
        elif kind == "stop":
            return
        # "ping": the leader is alive and idle; wait again


def serve_tensor_parallel(checkpoint: str, engine_cfg: EngineConfig, *, model_name, host: str, port: int,
                          drain_timeout_s: float, log_level: str, timeout_s: float = 600.0, **server_options) -> int:
    """Under torchrun: build the TP mesh over all ranks, load the sharded model, serve from rank 0
    (`server_options`: `serve`'s config and api_key)."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshtron.inference.server import serve
    from meshtron.parallel.distributed import init_distributed, world_from_env
    from meshtron.training.trainer import resolve_device

    rank, _, world_size = world_from_env()
    device = resolve_device(engine_cfg.device)
    init_distributed(device, timeout_s)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # objects travel on CPU
    try:
        if rank != LEADER:
            follow(LLMEngine.from_checkpoint(checkpoint, engine_cfg, tp_mesh=mesh).runner, group)
            return 0

        leader = Leader(group, ping_s=timeout_s / 4)

        def factory() -> LLMEngine:
            return lead(LLMEngine.from_checkpoint(checkpoint, engine_cfg, tp_mesh=mesh, model_name=model_name), leader)

        try:
            return serve(factory, host, port, drain_timeout_s=drain_timeout_s, log_level=log_level, **server_options)
        finally:
            leader("stop")  # release the followers even if the engine never came up
    finally:
        dist.destroy_process_group()
