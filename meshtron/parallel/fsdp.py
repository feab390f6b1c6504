"""Fully sharded data parallelism (FSDP2 `fully_shard`) applied per sublayer, then to the root.

Math: each parameter is split along dim 0 over the `dp_shard_cp` ranks. Forward all-gathers a
sublayer's parameters just before it runs (and frees them after, unless reshard_after_forward is
off: ZeRO-2); backward all-gathers again, computes, and reduce-scatters the gradients so each rank
keeps the gradient shard of its parameter shard. With dp_replicate > 1 (HSDP) the mesh is 2-D:
shards within `dp_shard_cp`, and the gradient shards are all-reduced across `dp_replicate`.
Gradients are summed, not averaged: the trainer already divides the loss by the global number of
loss tokens. Mixed precision computes in bf16 and reduces gradients in fp32.
Under expert parallelism the routed experts of each MoE sublayer are sharded first, on their own mesh
(`expert_mesh`: the dp_shard x cp ranks that ep leaves, see parallel/dims.py): their weights are
already split over `ep`, and the gradient of an expert slice sums the tokens of its whole ep group, so
it is reduce-scattered over the remaining data ranks only. Dim 0 is sharded when it divides evenly
over them, else dim 1.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from meshtron.nn.moe.layer import MoELayer


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype | None,
               reshard_after_forward: bool = True, cpu_offload: bool = False,
               expert_mesh: DeviceMesh | None = None) -> None:
    """Shard every sublayer of `model` (GPTModel or a pipeline stage) and then the root; with
    `expert_mesh` (expert parallelism), the routed experts of each MoE sublayer first, over it."""
    layers = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    for i, layer in enumerate(layers):
        # the last sublayer's parameters are needed again at once by backward: keep them gathered
        reshard = reshard_after_forward and i < len(layers) - 1
        if expert_mesh is not None and isinstance(layer.mixer, MoELayer):
            experts = layer.mixer.experts
            dim = 0 if experts.w_up.to_local().shape[0] % expert_mesh.size() == 0 else 1
            apply_fsdp_unit(experts, expert_mesh, param_dtype=param_dtype, cpu_offload=cpu_offload,
                            reshard_after_forward=reshard, shard_dim=dim)
        apply_fsdp_unit(layer, dp_mesh, param_dtype=param_dtype, cpu_offload=cpu_offload,
                        reshard_after_forward=reshard)
    apply_fsdp_unit(model, dp_mesh, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward,
                    cpu_offload=cpu_offload)


def apply_fsdp_unit(module: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype | None,
                    reshard_after_forward: bool = True, cpu_offload: bool = False, shard_dim: int = 0) -> None:
    """One FSDP unit: `module`'s parameters not already in a unit below it, split along `shard_dim`.
    A unit gathers its parameters whenever it is called, also from outside its parent's forward
    (distillation calls its projections on hidden states after the model's forward)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if cpu_offload else {}
    placement = {"shard_placement_fn": lambda param: Shard(shard_dim)} if shard_dim else {}
    fully_shard(module, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **offload,
                **placement)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
