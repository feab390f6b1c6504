"""Process-group start-up (the process's GPU, NCCL's flight recorder, refusing a torchrun restart policy
that cannot restart) and small collective helpers shared by the parallel code and the trainer."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Optional

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


def cuda_device_index(local_rank: int, device_count: int, visible: Optional[str] = None) -> int:
    """The CUDA device of this process. torchrun shows every process all of the node's GPUs: device
    LOCAL_RANK. A launcher that gives each task its own GPU (SLURM --gpus-per-task=1, a per-task
    CUDA_VISIBLE_DEVICES) shows one: device 0 whatever the local rank. Anything else would put two
    processes on one GPU (NCCL refuses) or guess: refused in one line."""
    if device_count < 1:
        raise ConfigError("train.device: cuda, but this process sees no GPU (CUDA_VISIBLE_DEVICES="
                          f"{visible!r}); use device cpu or give every process a GPU")
    if local_rank < device_count:
        return local_rank
    if device_count == 1:
        return 0
    raise ConfigError(f"LOCAL_RANK {local_rank}: this process sees only {device_count} GPUs (CUDA_VISIBLE_DEVICES="
                      f"{visible!r}); start at most {device_count} processes per node, or show each process "
                      "exactly one GPU")


NCCL_TRACE_DIR = "nccl_trace"


def configure_nccl_debugging(run_dir: Optional[str | Path], env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Before the first NCCL group: keep NCCL's flight recorder (the last collectives of every group,
    with their sequence numbers and states) and dump it when a collective times out, to
    <run_dir>/nccl_trace/rank_<N> (read with `torchfrtrace`). NCCL's watchdog ends the process at the
    timeout, so this dump, and the watchdog's early report (parallel/watchdog.py), is what names the
    collective that hung. Variables already set by the user are kept; returns what was set."""
    env = os.environ if env is None else env
    wanted = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_NCCL_ENABLE_MONITORING": "1"}
    if run_dir is not None:
        trace_dir = Path(run_dir) / NCCL_TRACE_DIR
        trace_dir.mkdir(parents=True, exist_ok=True)
        prefix = str(trace_dir / "rank_")
        wanted.update({"TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix})
    applied = {k: v for k, v in wanted.items() if k not in env}
    env.update(applied)
    return applied


def init_distributed(device: torch.device, timeout_s: float, run_dir: Optional[str | Path] = None) -> int:
    """Start the default process group when launched with several processes; return the world size.
    On CUDA: this process's GPU (see `cuda_device_index`), NCCL's flight recorder dumping into
    `run_dir`, and `device_id=` so NCCL connects now (eagerly) rather than at the first collective."""
    _, local_rank, world_size = world_from_env()
    if world_size == 1 or dist.is_initialized():
        return dist.get_world_size() if dist.is_initialized() else 1
    check_restartable()
    if device.type == "cuda":
        index = cuda_device_index(local_rank, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        torch.cuda.set_device(index)
        configure_nccl_debugging(run_dir)
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), device_id=torch.device("cuda", index))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return world_size


def group_device(group=None) -> torch.device:
    """The device a collective on `group` takes its tensors on: the process's GPU for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (each rank used the input for a share)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Sum over the group forward; identity backward (what follows is replicated over the group)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """`x` as is; its gradient summed over `group` (Megatron's copy to the tensor-parallel region)."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    """`x` summed over `group`; the gradient passed through as is (Megatron's reduce from the region)."""
    return _ReduceFromGroup.apply(x, group)


def all_reduce_sum(value: torch.Tensor, group) -> torch.Tensor:
    """Sum a tensor over a process group (a no-op for a group of one)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value
