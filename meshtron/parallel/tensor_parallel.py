"""Tensor and sequence parallelism as DTensor plans applied per sublayer type (Megatron-style).

Math, with t = tp degree:
- Attention: Wq, Wk, Wv are column-parallel (each rank owns heads/t query heads and kv_heads/t
  key/value heads; no communication in forward); Wo is row-parallel (partial sums are all-reduced,
  or reduce-scattered along the sequence under SP). Backward mirrors it (all-reduce of the input
  gradient of the column-parallel layers, or all-gather/reduce-scatter under SP).
- MLP: W_gate, W_up column-parallel; W_down row-parallel (same collectives as attention).
- Multi-latent attention: the up-projections to heads (W_q or W_qb, W_kvb) column-parallel, W_o
  row-parallel; the down-projections to the latents (W_qa, W_kva) and their norms run whole on every
  rank. The latents' gradients arrive summed through the column-parallel inputs; the RoPE key k_r (the
  tail of W_kva's output, shared by all heads) is differentiated through local heads only, so its
  gradient is all-reduced in backward (`SumGradOfLastFeatures`).
- Mamba-2: the z, x, B, C and dt projections are column-parallel (each rank owns heads/t heads and
  the groups/t groups of B and C those heads read); the conv weights of x, B, C, the per-head
  A_log, D, dt_bias and the gated norm's weight are split the same way (Shard(0)), so the conv,
  the scan and the per-group norm run on local channels with no communication; out_proj is
  row-parallel (all-reduce, or reduce-scatter along the sequence under SP).
- Embedding: vocab-parallel (rows split; masked lookup, then all-reduce or reduce-scatter).
- Output head: column-parallel over the vocabulary; with loss_parallel the logits stay sharded
  and the cross-entropy reduces max/sum-exp across ranks (no full-vocabulary gather). With tied
  embeddings the head is the embedding's own vocabulary shard (one parameter, two uses: its gradient
  is the sum of both, computed locally on the shard).
- Sequence parallel: activations outside attention/MLP (norms, dropout, residual adds) are split
  along the sequence; each attention/MLP input is all-gathered and each output reduce-scattered.
- MoE: every tp rank routes the full (replicated) tokens and runs the routed experts, which are split
  over the `ep` axis instead (parallel/expert_parallel.py), so router and experts need no tp
  communication; the shared experts are column/row-parallel like the MLP. Under SP the sublayer's input
  is all-gathered and its (replicated) output split along the sequence, each rank keeping its part.

Each sublayer symbol's plan is a function in `TP_PLANS` (keyed like models/blocks.py:SUBLAYERS) that
returns (path, ParallelStyle) pairs; `tp_plan(model, ...)` lists them for a whole model. `apply_tp`
applies exactly that list, and `meshtron plan` reads each parameter's placement off the same list.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshtron.api import internal_api
from meshtron.config.fields import ConfigError
from meshtron.nn.mla import MultiLatentAttention
from meshtron.parallel.distributed import copy_to_group

Plan = list[tuple[str, ParallelStyle]]  # (submodule path, "" for the module itself; its style), applied in order


@internal_api
class ShardParameters(ParallelStyle):
    """Distribute a module's named parameters (its own, or its children's by dotted name) with the given
    placements, e.g. Mamba's per-head A_log as Shard(0). No hook: the module computes on local shards."""

    def __init__(self, placements: dict[str, Placement]):
        super().__init__()
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            param = getattr(owner, leaf)
            if param is not None:
                setattr(owner, leaf, nn.Parameter(distribute_tensor(param.data, device_mesh, [placement])))
        return module


@internal_api
class SumGradOfLastFeatures(ParallelStyle):
    """Identity forward on the module's output; in backward the gradient of its last `width` features
    is summed over the tp ranks (Megatron's copy to the tensor-parallel region). MLA's W_kva ends with
    k_r, the RoPE key dims all heads share, which each rank differentiates through its own heads only."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, width = device_mesh.get_group(), self.width

        def shared_tail(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            return torch.cat([out[..., :-width], copy_to_group(out[..., -width:], group)], dim=-1)

        module.register_forward_hook(shared_tail)
        return module


def _gather_input(seq: Placement, use_local_output: bool = False) -> Plan:
    """Under SP the mixer's input (batch, seq/t, hidden) is all-gathered along the sequence."""
    if seq == Replicate():
        return []
    return [("", PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                    use_local_output=use_local_output))]


@internal_api
def attention_plan(mixer: nn.Module, seq: Placement) -> Plan:
    if isinstance(mixer, MultiLatentAttention):
        return mla_plan(mixer, seq)
    plan = _gather_input(seq) + [("wq", ColwiseParallel()), ("wk", ColwiseParallel()), ("wv", ColwiseParallel()),
                                 ("wo", RowwiseParallel(output_layouts=seq))]
    if getattr(mixer, "sinks", None) is not None:
        # learnable sink logits belong to query heads: split them by head like Wq's columns
        plan.append(("", ShardParameters({"sinks": Shard(0)})))
    return plan


@internal_api
def mla_plan(mixer: MultiLatentAttention, seq: Placement) -> Plan:
    """The up-projections to heads (W_q or W_qb, W_kvb) column-parallel, W_o row-parallel; the
    down-projections to the latents (W_qa, W_kva) and their norms stay whole on every rank (their
    outputs' gradients arrive summed: through the column-parallel inputs, and for k_r by its hook)."""
    query = [("wq", ColwiseParallel())] if mixer.wq is not None else [("wq_b", ColwiseParallel())]
    plan = _gather_input(seq, use_local_output=True) + query + [
        ("wkv_a", SumGradOfLastFeatures(mixer.qk_pos_emb_head_dim)), ("wkv_b", ColwiseParallel()),
        ("wo", RowwiseParallel(output_layouts=seq))]
    if mixer.sinks is not None:
        plan.append(("", ShardParameters({"sinks": Shard(0)})))
    return plan


@internal_api
def mlp_plan(mixer: nn.Module, seq: Placement, output: Placement | None = None) -> Plan:
    gate = [("w_gate", ColwiseParallel())] if mixer.w_gate is not None else []
    return gate + [("w_up", ColwiseParallel()), ("w_down", RowwiseParallel(output_layouts=output or seq))]


def mlp_sublayer_plan(mixer: nn.Module, seq: Placement) -> Plan:
    """The MLP sublayer: under SP its input is all-gathered once at the mixer, for w_gate and w_up both
    (without it a sequence-sharded DTensor reaches the column-parallel projections, which compiled
    sublayers turn into a graph break on a data-dependent op)."""
    return _gather_input(seq) + mlp_plan(mixer, seq)


# Mamba-2 parameters that belong to heads or channels, split by dim 0 like the projections that feed them
MAMBA_SHARDED = ("A_log", "D", "dt_bias", "norm.weight", "conv_x.weight", "conv_x.bias", "conv_b.weight",
                 "conv_b.bias", "conv_c.weight", "conv_c.bias")


@internal_api
def mamba_plan(mixer: nn.Module, seq: Placement) -> Plan:
    projections = [(f"{p}_proj", ColwiseParallel()) for p in ("z", "x", "b", "c", "dt")]
    by_channel = ShardParameters(dict.fromkeys(MAMBA_SHARDED, Shard(0)))
    return _gather_input(seq) + projections + [("out_proj", RowwiseParallel(output_layouts=seq)), ("", by_channel)]


@internal_api
def moe_plan(mixer: nn.Module, seq: Placement) -> Plan:
    """Router and routed experts stay whole here (expert parallelism splits the experts)."""
    plan: Plan = []
    if seq != Replicate():
        plan.append(("", PrepareModuleInputOutput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_input=True,
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True)))
    if mixer.shared_experts is not None:
        plan += [(f"shared_experts.{path}", style)
                 for path, style in mlp_plan(mixer.shared_experts, seq, output=Replicate())]
    return plan


# symbol -> the plan of its mixer given the layout of the sublayer's activations (Shard(1) under SP)
TP_PLANS: dict[str, Callable[[nn.Module, Placement], Plan]] = {
    "*": attention_plan, "-": mlp_sublayer_plan, "M": mamba_plan, "E": moe_plan,
}


def check_tp_divisibility(model: nn.Module, tp: int) -> None:
    cfg = model.cfg
    if "M" in cfg.pattern and (cfg.mamba_heads % tp or cfg.mamba_num_groups % tp):
        raise ConfigError(f"parallel.tp: {tp} must divide the Mamba heads ({cfg.mamba_heads}) and "
                          f"model.mamba_num_groups={cfg.mamba_num_groups}; change one of them")
    if cfg.num_attention_heads % tp or cfg.num_kv_heads % tp:
        raise ConfigError(f"parallel.tp: {tp} must divide model.num_attention_heads={cfg.num_attention_heads} "
                          f"and the key/value heads ({cfg.num_kv_heads}); change one of them")
    if cfg.ffn_size % tp:
        raise ConfigError(f"parallel.tp: {tp} must divide the MLP width {cfg.ffn_size} (model.ffn_hidden_size)")
    shared = getattr(cfg, "moe_shared_expert_intermediate_size", None)
    if shared and shared % tp:
        raise ConfigError(f"parallel.tp: {tp} must divide model.moe_shared_expert_intermediate_size={shared}")
    if model.vocab_size % tp:
        raise ConfigError(f"parallel.tp: {tp} must divide the padded vocabulary {model.vocab_size}; "
                          "set model.make_vocab_size_divisible_by to a multiple of tp")


@internal_api
def sublayer_plan(layer: nn.Module, sequence_parallel: bool) -> Plan:
    """The plan of one `Sublayer`: its norm (SP: replicated weight, sequence-split activations) and mixer."""
    if layer.symbol not in TP_PLANS:
        raise ConfigError(f"parallel.tp: sublayer '{layer.symbol}' has no tensor-parallel plan")
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = [("norm", SequenceParallel())] if sequence_parallel else []
    return norm + [(f"mixer.{path}".rstrip("."), style) for path, style in TP_PLANS[layer.symbol](layer.mixer, seq)]


def tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> Plan:
    """Every (path, style) of `model` (a GPTModel or a pipeline stage of one), in the order applied."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: Plan = []
    for name in ("embedding", "position_embedding"):
        if getattr(model, name, None) is not None:
            plan.append((name, RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)))
    if getattr(model, "final_norm", None) is not None and sequence_parallel:
        plan.append(("final_norm", SequenceParallel()))
    if getattr(model, "output", None) is not None:
        plan.append(("output", ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel
                                               else Replicate(), use_local_output=not loss_parallel)))
    for key, layer in model.layers.named_children():
        plan += [(f"layers.{key}.{path}", style) for path, style in sublayer_plan(layer, sequence_parallel)]
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard `model` (a GPTModel or a pipeline stage of one) over `tp_mesh` in place."""
    check_tp_divisibility(model, tp_mesh.size())
    for path, style in tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel):
        parallelize_module(model.get_submodule(path), tp_mesh, style)
    if getattr(model, "output", "absent") is None and getattr(model, "embedding", None) is not None:
        # tied embeddings: the head multiplies by this rank's rows of the (vocab-parallel) embedding
        model.head = partial(_tied_vocab_parallel_head, model, tp_mesh, loss_parallel)


def _tied_vocab_parallel_head(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool,
                              h: torch.Tensor) -> torch.Tensor:
    """Logits with the output head tied to the vocab-parallel embedding: rank r holds vocabulary rows
    [r V/t, (r+1) V/t) of E, and the same shard is its column-parallel head, logits_r = h E_r^T. The
    hidden states are all-gathered along the sequence first under SP. The embedding's gradient is the
    sum of the lookup's (rows of the tokens seen) and the head's (h^T dlogits_r), both on the shard."""
    # h: (batch, seq, hidden), a Shard(1) DTensor under SP, else the same plain tensor on every rank
    if not isinstance(h, DTensor):
        h = DTensor.from_local(h, tp_mesh, [Replicate()], run_check=False)
    logits = nn.functional.linear(h.redistribute(tp_mesh, [Replicate()]), model.embedding.weight)
    if loss_parallel:
        return logits  # (batch, seq, vocab) sharded along the vocabulary: vocab-parallel cross-entropy
    return logits.redistribute(tp_mesh, [Replicate()]).to_local()
