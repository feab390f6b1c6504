"""Tensor-parallel engines led by one rank: the ranks of a TP group hold one sharded model; the group's
leader (any rank of the group, named explicitly) runs the whole engine (scheduler, KV block
accounting, sampling; HTTP when serving) and the others follow, running the same sharded forward on
each step's chunks, which the leader broadcasts before its own forward. Keys/values stay sharded by
head on every rank; only the step's plain `ScheduledChunk`s (token ids, positions, block tables)
travel. One world may hold several groups, each with its own leader (data-parallel replicas of a TP
model: `meshtron serve` under torchrun, RL rollouts in `meshtron.rl.inference`; `meshtron serve
--coordinator ADDR` under torchrun registers a TP group as one replica of data-parallel serving).

Messages: ("step", chunks), ("release", None) on suspend, ("stop", None) at the end, and
("ping", None) whenever the leader has sent nothing for `ping_s` (a quarter of the timeout): a
follower's wait is a broadcast with the group's timeout, so without pings an idle server lost its
followers after `timeout_s` (10 minutes) and then hung in its next request's all-reduce. A follower
still notices a leader that died, within the timeout. Pings come from a thread, so they need a group
that carries nothing but messages (`message_group` makes one on gloo: the objects travel on the CPU
and never interleave with the model's collectives); without pings the model's own TP group will do
(the broadcast's tensors go on the group's device: the GPU under NCCL).

    torchrun --nproc-per-node 2 -m meshtron serve --checkpoint DIR --port 8000
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshtron.inference.config import EngineConfig
from meshtron.inference.engine import LLMEngine
from meshtron.inference.runner import ModelRunner
from meshtron.parallel.distributed import group_device

LEADER = 0  # the leader's rank in its group unless told otherwise


class TPGroup:
    """The ranks of `group` (a process group; None: the world) and the one of them that leads:
    `leader` is its rank within the group. `broadcast` sends the leader's object to the others."""

    def __init__(self, group=None, leader: int = LEADER):
        self.group = group if group is not None else dist.group.WORLD
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if not 0 <= leader < self.size:
            raise ValueError(f"leader: {leader} is not a rank of this group of {self.size}; give its rank in the group")
        self.leader, self.leader_global = leader, dist.get_global_rank(self.group, leader)
        self.is_leader = self.rank == leader
        self.device = group_device(self.group)

    def broadcast(self, obj: Any = None) -> Any:
        """The leader's `obj` on every rank of the group (what the others pass is ignored)."""
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=self.leader, device=self.device)
        return box[0]


def _as_tp_group(group, leader: int) -> TPGroup:
    return group if isinstance(group, TPGroup) else TPGroup(group, leader)


def message_group(tp_mesh: DeviceMesh, timeout_s: float, leader: int = LEADER) -> TPGroup:
    """A gloo group of its own over the ranks of `tp_mesh` (a 1-D mesh: this rank's TP group), led by
    `leader` (a rank of the group). Every rank of the world calls it: each TP group of the world
    gets its group here, so several replicas each have their own leader."""
    mine = [int(r) for r in tp_mesh.mesh.flatten().tolist()]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # the default group's collective; its device is chosen by torch
    groups = sorted({tuple(g) for g in everyone})
    group, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups], timeout=timedelta(seconds=timeout_s),
                                                 backend="gloo")
    return TPGroup(group, leader)


def broadcast(kind: str, payload: Any = None, group=None, *, leader: int = LEADER) -> None:
    """Send one message from the leader (`leader`: its rank in `group`)."""
    _as_tp_group(group, leader).broadcast((kind, payload))


class Leader:
    """The engine's step hook on the group's leader: forwards each message to the followers; 'stop'
    only once (after it the followers are gone and a broadcast would wait forever). `group` is a
    `TPGroup` or a process group led by its rank `leader`. With `ping_s`, a thread sends ("ping",
    None) whenever nothing was sent for that long; a lock keeps its broadcasts and the engine's in one
    order on the group."""

    def __init__(self, group=None, ping_s: Optional[float] = None, *, leader: int = LEADER):
        self.tp = _as_tp_group(group, leader)
        if not self.tp.is_leader:
            raise ValueError(f"Leader on rank {self.tp.rank} of a group led by its rank {self.tp.leader}")
        self.stopped = False
        self._lock = threading.Lock()
        self._sent_at = time.monotonic()
        self._done = threading.Event()
        if ping_s is not None:
            threading.Thread(target=self._ping, args=(ping_s,), name="meshtron-tp-ping", daemon=True).start()

    def __call__(self, kind: str, payload: Any = None) -> None:
        with self._lock:
            if self.stopped:
                return
            self.tp.broadcast((kind, payload))
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
    """Make `engine` (on the group's leader) announce every forward, suspend and shutdown to the followers."""
    engine.step_hook = leader
    return engine


def follow(runner: ModelRunner, group=None, *, leader: int = LEADER) -> None:
    """Run the leader's forwards until it stops (every rank of the group but the leader). `group`: a
    `TPGroup`, or a process group led by its rank `leader`."""
    tp = _as_tp_group(group, leader)
    while True:
        kind, payload = tp.broadcast()
        if kind == "step":
            runner.forward_only(payload)
        elif kind == "release":
            runner.release()
        elif kind == "stop":
            return
        # "ping": the leader is alive and idle; wait again


def serve_tensor_parallel(checkpoint: str, engine_cfg: EngineConfig, *, model_name, host: str, port: int,
                          drain_timeout_s: float, log_level: str, timeout_s: float = 600.0, **server_options) -> int:
    """Under torchrun: one TP group over all ranks (the 'tp' axis of `ParallelDims`' mesh), the
    sharded model loaded on each, served from the group's rank 0 (`server_options`: `serve`'s config
    and api_key)."""
    from meshtron.inference.server import serve

    def run(factory: Callable[[], LLMEngine]) -> int:
        return serve(factory, host, port, drain_timeout_s=drain_timeout_s, log_level=log_level, **server_options)

    return run_tensor_parallel(checkpoint, engine_cfg, run, model_name=model_name, timeout_s=timeout_s)


def run_tensor_parallel(checkpoint: str, engine_cfg: EngineConfig, lead_with: Callable[[Callable[[], LLMEngine]], int],
                        *, model_name: Optional[str] = None, timeout_s: float = 600.0) -> int:
    """Under torchrun: the TP group over all ranks; rank 0 calls `lead_with(factory)` (factory: its
    leading engine; an HTTP server, or a data-parallel replica's worker) and returns what it returns,
    the others follow until it stops."""
    from meshtron.parallel.dims import ParallelDims
    from meshtron.parallel.distributed import init_distributed, world_from_env
    from meshtron.training.trainer import resolve_device

    world_size = world_from_env()[2]
    device = resolve_device(engine_cfg.device)
    init_distributed(device, timeout_s)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1, world_size=world_size)
    mesh = dims.build_mesh(device.type, timeout_s)["tp"]
    tp = message_group(mesh, timeout_s)
    try:
        if not tp.is_leader:
            follow(LLMEngine.from_checkpoint(checkpoint, engine_cfg, tp_mesh=mesh).runner, tp)
            return 0

        leader = Leader(tp, ping_s=timeout_s / 4)

        def factory() -> LLMEngine:
            return lead(LLMEngine.from_checkpoint(checkpoint, engine_cfg, tp_mesh=mesh, model_name=model_name), leader)

        try:
            return lead_with(factory)
        finally:
            leader("stop")  # release the followers even if the engine never came up
    finally:
        dist.destroy_process_group()
