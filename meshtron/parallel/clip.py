"""Gradient-norm clipping over parameters sharded by TP/FSDP (DTensors) and split over pipeline
stages: the squared local norms are summed across the pipeline group before the square root, so
every rank clips with the same global norm. Everything stays on the device: one host sync per call
(the norm it returns), one foreach kernel per group of gradients to scale them."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtron.parallel.distributed import group_device

Annotate = Optional[Callable[[str], AbstractContextManager]]


def grad_groups(parameters: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """The parameters with a gradient, grouped so that one foreach kernel can take each group: plain
    tensors (replicated) and DTensors on different meshes (TP, FSDP, FSDP x TP) cannot be mixed."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    return list(groups.values())


def global_grad_norm(parameters: list[torch.nn.Parameter], pp_group=None, annotate: Annotate = None) -> torch.Tensor:
    """The 2-norm of all gradients over every rank, a 0-d fp32 tensor on the gradients' device.
    `annotate(name)`, if given, is entered around the reductions (the trainer's "communication" range)."""
    communication = (lambda: annotate("communication")) if annotate is not None else nullcontext
    groups = grad_groups(parameters)
    device = groups[0][0].grad.device if groups else group_device(pp_group) if pp_group is not None else None
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for params in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            with communication():
                norm = norm.full_tensor()  # reduces the partial norms over the sharded mesh axes
        squared = squared + norm.float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        with communication():
            dist.all_reduce(squared, group=pp_group)
    return squared.sqrt()


def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float, pp_group=None,
                    annotate: Annotate = None, duplicates: tuple[torch.nn.Parameter, ...] = ()) -> float:
    """Clip in place to `max_norm` (inf: measure only); return the global norm before clipping.
    `duplicates` (a pipeline's copy of a tied embedding) are clipped but left out of the norm."""
    skip = {id(p) for p in duplicates}
    norm = global_grad_norm([p for p in parameters if id(p) not in skip], pp_group, annotate)
    total = float(norm)  # the one host sync: the trainer needs the number to log it and to skip non-finite steps
    if math.isfinite(max_norm) and math.isfinite(total) and max_norm / (total + 1e-6) < 1.0:
        for params in grad_groups(parameters):
            # grad *= max_norm / (norm + 1e-6), one foreach kernel per group (not one kernel per parameter)
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return total
