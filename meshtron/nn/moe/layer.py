"""The MoE sublayer ('E' in the layer pattern): route, build the routing map, dispatch, run the
experts, combine, add the shared experts.

    y = sum_{e in top-k(x)} p_e(x) * expert_e(x)  [+ g(x) * shared(x)],  g = sigmoid(x w_g) or 1

The router's auxiliary loss joins the training objective through autograd, not through the return
value: `attach_aux_loss` passes y through unchanged and, in backward, gives the aux loss the gradient
`aux_loss_scale` (set by the trainer to this forward's share of the step's loss normalisation). So the
loss function, pipeline schedules and activation recomputation need not know MoE exists.
Training forwards also accumulate statistics (`MoEStats`) that the trainer logs and that drive the
expert-bias update of auxiliary-loss-free balancing.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import torch
from torch import nn

from meshtron.compat import grouped_mm_reads_offsets, grouped_mm_supported, is_fake
from meshtron.config.schema import ModelConfig
from meshtron.nn.mlp import MLP
from meshtron.nn.moe.dispatcher import LocalDispatcher, TokenDispatcher, permute, unpermute
from meshtron.nn.moe.experts import GroupedExperts
from meshtron.nn.moe.router import build_router
from meshtron.nn.moe.routing_map import RowBound, build_routing_map


class _AuxLossScaler(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """`output`, unchanged; backward through it also backpropagates `scale * aux_loss`."""
    if not aux_loss.requires_grad or not torch.is_grad_enabled():
        return output
    return _AuxLossScaler.apply(output, aux_loss, scale)


class MoEStats:
    """Per-layer sums over the training forwards since the last `reset` (a recomputed forward counts
    twice in every sum, which leaves the reported fractions and means unchanged)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.tokens_per_expert: Optional[torch.Tensor] = None  # (experts,) float64 choices before dropping
        self.num_chosen = 0.0
        self.num_dropped: Optional[torch.Tensor] = None
        self.losses: dict[str, list] = {}  # name -> [sum of values, count]
        self.num_forwards = 0

    def add(self, tokens_per_expert: torch.Tensor, num_chosen: int, num_dropped: torch.Tensor,
            losses: dict[str, torch.Tensor]) -> None:
        tpe = tokens_per_expert.detach().to(torch.float64)
        self.tokens_per_expert = tpe if self.tokens_per_expert is None else self.tokens_per_expert + tpe
        dropped = num_dropped.detach().to(torch.float64)
        self.num_dropped = dropped if self.num_dropped is None else self.num_dropped + dropped
        self.num_chosen += num_chosen
        for name, value in losses.items():
            acc = self.losses.setdefault(name, [0.0, 0])
            acc[0], acc[1] = acc[0] + value.detach().float(), acc[1] + 1
        self.num_forwards += 1


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = cfg.num_moe_experts
        self.num_experts, self.topk = E, cfg.moe_router_topk
        self.capacity_factor, self.drop_policy = cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy
        self.pad_alignment = cfg.moe_router_padding_alignment if cfg.moe_router_padding_for_quantization else None
        self.router = build_router(cfg)
        self.experts = GroupedExperts(E, cfg.hidden_size, cfg.moe_ffn_size, cfg.activation, bias=cfg.add_bias_linear,
                                      clamp_value=cfg.activation_func_clamp_value, linear_offset=cfg.glu_linear_offset,
                                      grouped=cfg.moe_grouped_gemm)
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = (MLP(cfg.hidden_size, shared, cfg.activation, bias=cfg.add_bias_linear,
                                   clamp_value=cfg.activation_func_clamp_value, linear_offset=cfg.glu_linear_offset)
                               if shared else None)
        self.shared_expert_gate = (nn.Linear(cfg.hidden_size, 1, bias=False)
                                   if shared and cfg.moe_shared_expert_gate else None)
        # a plain attribute, not a submodule: expert parallelism installs its own (meshtron/parallel)
        self.dispatcher: TokenDispatcher = LocalDispatcher()
        self.aux_loss_scale = 1.0
        self.stats = MoEStats(E)
        self.paused = False  # set by moe_bookkeeping_paused: no statistics, no router replay

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """x (batch, seq, hidden) -> (batch, seq, hidden)."""
        batch, seq, hidden = x.shape
        replay = getattr(self.router, "replay", None)
        if replay is not None:
            replay.paused = self.paused
        probs, indices, aux_loss = self.router(x)
        tokens = x.reshape(-1, hidden)
        if is_fake(tokens):
            return self._traced_forward(tokens, probs, indices, aux_loss).view(batch, seq, hidden).to(x.dtype)
        routing = build_routing_map(probs, indices, self.num_experts, self.capacity_factor, self.drop_policy,
                                    self.pad_alignment)
        row_bound = RowBound(self.topk, self.num_experts, self.capacity_factor, self.pad_alignment)
        bound = {"row_bound": row_bound} if _takes_row_bound(self.dispatcher.dispatch) else {}
        expert_input, tokens_per_expert, handle = self.dispatcher.dispatch(tokens, routing.probs, routing.routing_map,
                                                                           **bound)
        expert_output = self.experts(expert_input, tokens_per_expert)
        y = self.dispatcher.combine(expert_output, handle)
        y = self._add_shared(tokens, y)
        if self.training and torch.is_grad_enabled() and not self.paused:
            losses = getattr(self.router, "last_losses", None)
            self.stats.add(routing.tokens_per_expert, routing.num_chosen, routing.num_dropped,
                           {"aux_loss": aux_loss.detach()} if losses is None else losses)
        y = attach_aux_loss(y, aux_loss, self.aux_loss_scale)
        return y.view(batch, seq, hidden).to(x.dtype)

    def host_sync_reasons(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        """Why a forward of this sublayer in `dtype` on `device` reads the device on the host (stalling a
        GPU and preventing CUDA-graph capture); empty when it never does."""
        reasons = []
        reads = getattr(self.dispatcher, "host_reads", None)
        if reads != 0:
            reasons.append(f"the token dispatcher ({type(self.dispatcher).__name__}) reads "
                           f"{'an unknown number of values' if reads is None else reads} per forward")
        x = torch.empty(0, self.experts.w_up.shape[-1], dtype=dtype, device=device)
        w = torch.empty(self.experts.w_up.shape, dtype=dtype, device="meta").transpose(1, 2)
        if not (self.experts.grouped and grouped_mm_supported(x, w)):
            reasons.append("the experts run as a loop over their token counts (model.moe_grouped_gemm false, "
                           "a dtype other than fp32/bf16/fp16, or widths whose rows are not 16-byte multiples)")
        elif grouped_mm_reads_offsets(x):
            reasons.append("the grouped GEMM copies its offsets to the host (CUDA: only bf16 on compute "
                           "capability 9.x/10.x reads them on the device)")
        return reasons

    def _add_shared(self, tokens: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is None:
            return y
        shared = self.shared_experts(tokens)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
        return y + shared

    def _traced_forward(self, tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor,
                        aux_loss: torch.Tensor) -> torch.Tensor:
        """Fake or meta tensors (meshtron plan's activation trace): routing has no values, so every
        choice is kept and the experts share the rows evenly; the ops, and the tensors they save for
        backward, are those of a balanced dropless forward (the same dispatch, the experts looped)."""
        routing = build_routing_map(probs, indices, self.num_experts)
        rows, _, handle = permute(tokens, routing.probs, routing.routing_map, tokens.shape[0] * indices.shape[1])
        R, E = rows.shape[0], self.num_experts
        counts = [R // E + (1 if e < R % E else 0) for e in range(E)]
        y = unpermute(self.experts(rows, counts), handle)
        return attach_aux_loss(self._add_shared(tokens, y), aux_loss, self.aux_loss_scale)


@functools.lru_cache(maxsize=64)
def _accepts_row_bound(dispatch_function) -> bool:
    try:
        parameters = inspect.signature(dispatch_function).parameters
    except (TypeError, ValueError):
        return False
    return "row_bound" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _takes_row_bound(dispatch) -> bool:
    """Whether a dispatcher's `dispatch` takes the `row_bound` keyword (dispatchers written before it
    existed get the three positional arguments only)."""
    return _accepts_row_bound(getattr(dispatch, "__func__", dispatch))
