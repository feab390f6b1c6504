"""CUDA memory: the caching allocator set to expandable segments unless the user chose otherwise
(less fragmentation as activation shapes vary), and the peak allocated memory of each logging interval.
On a CPU neither applies: no peak is reported (a process's RSS high-water mark cannot be reset per
interval, so it would not say what one interval needed)."""

from __future__ import annotations

import os
from typing import Optional

import torch

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def configure_cuda_allocator(environ: Optional[dict] = None) -> bool:
    """Set expandable_segments:True when CUDA is available, the user set no allocator configuration
    and CUDA is not initialised yet (the allocator reads it once, at initialisation). -> set or not."""
    environ = os.environ if environ is None else environ
    if ALLOC_CONF in environ or "PYTORCH_ALLOC_CONF" in environ:
        return False
    if not torch.cuda.is_available() or torch.cuda.is_initialized():
        return False
    environ[ALLOC_CONF] = "expandable_segments:True"
    return True


def interval_peak_memory(device: torch.device) -> dict[str, float]:
    """{"peak_memory_gib": the most memory allocated on the device since the last call} on CUDA,
    resetting the peak so the next interval starts afresh; {} elsewhere."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"peak_memory_gib": peak}
