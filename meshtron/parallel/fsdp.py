"""Fully sharded data parallelism (FSDP2 `fully_shard`) applied per sublayer, then to the root.

Math: each parameter is split along dim 0 over the `dp_shard_cp` ranks. Forward all-gathers a
sublayer's parameters just before it runs (and frees them after, unless reshard_after_forward is
off: ZeRO-2); backward all-gathers again, computes, and reduce-scatters the gradients so each rank
keeps the gradient shard of its parameter shard. With dp_replicate > 1 (HSDP) the mesh is 2-D:
shards within `dp_shard_cp`, and the gradient shards are all-reduced across `dp_replicate`.
Gradients are summed, not averaged: the trainer already divides the loss by the global number of
loss tokens. Mixed precision computes in bf16 and reduces gradients in fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype | None,
               reshard_after_forward: bool = True, cpu_offload: bool = False) -> None:
    """Shard every sublayer of `model` (GPTModel or a pipeline stage) and then the root."""
    layers = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    for i, layer in enumerate(layers):
        # the last sublayer's parameters are needed again at once by backward: keep them gathered
        apply_fsdp_unit(layer, dp_mesh, param_dtype=param_dtype, cpu_offload=cpu_offload,
                        reshard_after_forward=reshard_after_forward and i < len(layers) - 1)
    apply_fsdp_unit(model, dp_mesh, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward,
                    cpu_offload=cpu_offload)


def apply_fsdp_unit(module: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype | None,
                    reshard_after_forward: bool = True, cpu_offload: bool = False) -> None:
    """One FSDP unit: `module`'s parameters not already in a unit below it. A unit gathers its
    parameters whenever it is called, also from outside its parent's forward (distillation calls
    its projections on hidden states after the model's forward)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if cpu_offload else {}
    fully_shard(module, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **offload)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
