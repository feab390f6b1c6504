"""Gradient-norm clipping over parameters sharded by TP/FSDP (DTensors) and split over pipeline
stages: the squared local norms are summed across the pipeline group before the square root, so
every rank clips with the same global norm."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

Annotate = Optional[Callable[[str], AbstractContextManager]]


def global_grad_norm(parameters: list[torch.nn.Parameter], pp_group=None, annotate: Annotate = None) -> torch.Tensor:
    """The 2-norm of all gradients over every rank. `annotate(name)`, if given, is entered around the
    reductions (the trainer's "communication" profiler range)."""
    communication = (lambda: annotate("communication")) if annotate is not None else nullcontext
    # Plain tensors (replicated) and DTensors on different meshes (TP, FSDP, FSDP x TP) cannot be
    # mixed in one foreach kernel: take the norm of each group, then combine the squares.
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    squared = torch.zeros((), dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            with communication():
                norm = norm.full_tensor()  # reduces the partial norms over the sharded mesh axes
        squared = squared + norm.float().cpu() ** 2
    norm = squared.sqrt()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        squared = norm ** 2
        with communication():
            dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    return norm


def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float, pp_group=None,
                    annotate: Annotate = None, duplicates: tuple[torch.nn.Parameter, ...] = ()) -> float:
    """Clip in place to `max_norm` (inf: measure only); return the global norm before clipping.
    `duplicates` (a pipeline's copy of a tied embedding) are clipped but left out of the norm."""
    skip = {id(p) for p in duplicates}
    norm = global_grad_norm([p for p in parameters if id(p) not in skip], pp_group, annotate)
    if math.isfinite(max_norm) and math.isfinite(float(norm)):
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return float(norm)
