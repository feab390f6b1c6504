"""Process-group start-up (refusing a torchrun restart policy that cannot restart) and small collective
helpers shared by the parallel code and the trainer."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtron.config.fields import ConfigError


def world_from_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as set by torchrun (or 0, 0, 1 without it)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)))


def check_restartable(env: dict[str, str] | None = None) -> None:
    """Refuse, before any process group exists, torchrun restarts that cannot work: one line on every
    rank of every attempt instead of a restart stuck connecting. When torchrun's agent shares its store
    with the ranks (static rendezvous always; c10d unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), that
    store outlives an attempt and its process-group keys carry no attempt number: restarted ranks read
    the dead ranks' addresses and fail to connect (measured with torch 2.13, gloo; pytorch#135712)."""
    env = os.environ if env is None else env
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and int(env.get("WORLD_SIZE", "1")) > 1 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(f"torchrun --max-restarts {restarts}: a restarted job would reuse the launcher's store and "
                          "fail to connect; run torchrun with --rdzv-backend c10d (or --standalone) and "
                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")


def init_distributed(device: torch.device, timeout_s: float) -> int:
    """Start the default process group when launched with several processes; return the world size."""
    _, local_rank, world_size = world_from_env()
    if world_size == 1 or dist.is_initialized():
        return dist.get_world_size() if dist.is_initialized() else 1
    check_restartable()
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return world_size


def all_reduce_sum(value: torch.Tensor, group) -> torch.Tensor:
    """Sum a tensor over a process group (a no-op for a group of one)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value
