"""Parallelism applied from outside the model, in a fixed order: split pipeline stages, then
tensor/sequence parallel, expert parallel, activation checkpointing, torch.compile, then FSDP (STYLE 3)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron.config.schema import RunConfig
from meshtron.parallel.activation_checkpoint import apply_activation_checkpoint
from meshtron.parallel.compile import apply_compile
from meshtron.parallel.dims import ParallelDims
from meshtron.parallel.expert_parallel import apply_ep
from meshtron.parallel.fsdp import apply_fsdp
from meshtron.parallel.tensor_parallel import apply_tp


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """1-D over dp_shard x cp, or 2-D (dp_replicate, dp_shard x cp) for HSDP."""
    return mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else mesh["dp_shard_cp"]


def expert_fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh | None:
    """Under expert parallelism the data ranks that share an expert slice: dp_shard_mod_ep (x dp_replicate)."""
    if dims.ep == 1:
        return None
    return mesh["dp_replicate", "dp_shard_mod_ep"] if dims.dp_replicate > 1 else mesh["dp_shard_mod_ep"]


def parallelize_parts(parts: list[nn.Module], dims: ParallelDims, mesh: DeviceMesh | None, cfg: RunConfig) -> None:
    """Apply float8 training (train.float8), TP, EP, activation checkpointing, compile and FSDP to each
    model part, in that order."""
    p = cfg.parallel
    for part in parts:
        if cfg.train.float8:  # float8 linears first: TP, compile and FSDP then wrap the converted modules
            from meshtron.parallel.float8 import apply_float8_training

            apply_float8_training(part, next(part.parameters()).device, tp=dims.tp)
        if dims.tp > 1:
            apply_tp(part, mesh["tp"], sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel)
        expert_axes = (("ep",) if dims.ep > 1 else ()) + (("tp",) if p.expert_tensor_parallel and dims.tp > 1 else ())
        if expert_axes:
            apply_ep(part, mesh[expert_axes if len(expert_axes) > 1 else expert_axes[0]], p.ep_dispatcher)
        if p.activation_checkpoint != "none":
            apply_activation_checkpoint(part, p.activation_checkpoint)
        if p.compile:
            apply_compile(part)
        if dims.fsdp_enabled:
            param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
            apply_fsdp(part, fsdp_mesh(mesh, dims), param_dtype=param_dtype,
                       reshard_after_forward=p.fsdp_reshard_after_forward, expert_mesh=expert_fsdp_mesh(mesh, dims))
