"""Process-group start-up and small collective helpers shared by the parallel code and the trainer."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def world_from_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as set by torchrun (or 0, 0, 1 without it)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)))


def init_distributed(device: torch.device, timeout_s: float) -> int:
    """Start the default process group when launched with several processes; return the world size."""
    _, local_rank, world_size = world_from_env()
    if world_size == 1 or dist.is_initialized():
        return dist.get_world_size() if dist.is_initialized() else 1
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
