"""Routers: which k experts each token goes to, with what weight, and the balancing losses.

A router is any module with `forward(x) -> (probs, indices, aux_loss)` (the `Router` protocol):
x (batch, seq, hidden) -> probs (tokens, k), indices (tokens, k) long, aux_loss a scalar already
weighted by its coefficients (tokens = batch * seq, row-major). Routers are built by name
(`model.moe_router_type`) from `ROUTERS`: the built-in ones, classes registered in-process with
`register_router("name")`, and plugins: an installed distribution that declares an entry point
`name = package.module:Class` in group `meshtron.routers` is found by name and imported only when a
config asks for that name, so `meshtron train` and torchrun use it without a script. A router class
takes the `ModelConfig`.

The built-in `TopKRouter` with logits l = x W^T (fp32 when moe_router_dtype is fp32):
    softmax, top-k after softmax (pre_softmax): s = softmax(l); pick top-k of s; p = s at the picks
    softmax, top-k before softmax:              pick top-k of l; p = softmax over the k picked logits
    sigmoid:                                    s = sigmoid(l); pick top-k of s; p = s at the picks,
                                                normalised to sum 1 when k > 1
    then p *= moe_router_topk_scaling_factor.
Picking may add a per-expert bias to the scores (auxiliary-loss-free balancing; the bias changes the
choice, never p) and may be group-limited (DeepSeek): experts form G groups, a group scores the sum
of its best k / group_topk experts, and only the best group_topk groups are eligible.
Balancing losses (switch-style, DeepSeek-V3 eq. 17-20) over T tokens and E experts, with s' the
scores normalised over all experts (softmax, or sigmoid / its row sum):
    aux_loss      coeff * E * sum_i f_i P_i,  f_i = (tokens with i in top-k(s'_t)) / (T k),  P_i = mean_t s'_ti
    seq_aux_loss  the same within each sequence, averaged over the sequences of the batch
    z_loss        coeff * mean_t logsumexp(l_t)^2
f_i counts the plain top-k of the unbiased scores, not the experts the token was sent to: the expert
bias, group limits and router replay change the dispatch but not the loss (DeepSeek-V3 eq. 18;
Megatron-LM's compute_routing_scores_for_aux_loss does the same).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Optional, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.config.registry import ROUTER_REGISTRY
from meshtron.config.schema import ModelConfig
from meshtron.nn.moe.replay import RouterReplay


@runtime_checkable
class Router(Protocol):
    """What a MoE layer calls: x (batch, seq, hidden) -> (probs (tokens, k), indices (tokens, k) long,
    aux_loss scalar). Optional: `replay` (a RouterReplay, for router replay) and `last_losses`
    (named detached loss terms for the logs)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


ROUTERS: dict[str, Callable[[ModelConfig], nn.Module]] = ROUTER_REGISTRY.registered  # name -> router class
ENTRY_POINT_GROUP = ROUTER_REGISTRY.entry_point_group


def check_router_class(cls: Any, name: str) -> None:
    """Raise a one-line TypeError unless `cls` is an nn.Module class whose forward takes x alone."""
    where = f"router {name!r} ({getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)!s})"
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"{where} must be a torch.nn.Module subclass taking the ModelConfig")
    forward = getattr(cls, "forward", None)
    if forward is None or forward is nn.Module.forward:
        raise TypeError(f"{where} defines no forward(x) -> (probs, indices, aux_loss)")
    try:
        inspect.signature(forward).bind(None, None)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: forward must take one argument x (batch, seq, hidden) and return "
                        "(probs, indices, aux_loss)") from None


def register_router(name: str):
    """Class decorator: make a router selectable as `model.moe_router_type: name`."""
    def add(cls):
        check_router_class(cls, name)
        ROUTER_REGISTRY.register(name, cls)
        return cls
    return add


def router_names() -> tuple[list[str], list[str]]:
    """(registered names, names only an entry point provides so far), each sorted."""
    return ROUTER_REGISTRY.names()


def router_class(name: str) -> Callable[[ModelConfig], nn.Module]:
    """The class registered as `name`, importing its entry point the first time it is asked for."""
    try:
        return ROUTER_REGISTRY.load(name, check_router_class)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_router(cfg: ModelConfig) -> nn.Module:
    return router_class(cfg.moe_router_type)(cfg)


# ---- pieces every router may use -------------------------------------------------------------------

def topk_indices(scores: torch.Tensor, k: int, num_groups: Optional[int] = None,
                 group_topk: Optional[int] = None) -> torch.Tensor:
    """(tokens, experts) -> indices (tokens, k) of the k best, restricted to the best `group_topk` of
    `num_groups` expert groups when those are given."""
    if num_groups is None or group_topk is None:
        return scores.topk(k, dim=-1).indices
    tokens, experts = scores.shape
    per_group = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = per_group.topk(k // group_topk, dim=-1).values.sum(-1)  # (tokens, groups)
    best_groups = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    allowed = allowed.unsqueeze(-1).expand_as(per_group).reshape(tokens, experts)
    return scores.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices


def load_balancing_loss(scores: torch.Tensor, indices: torch.Tensor, num_experts: int,
                        batch_size: int, per_sequence: bool) -> torch.Tensor:
    """E * sum_i f_i P_i (unweighted), over the whole batch or per sequence and averaged.
    scores (tokens, experts) normalised over experts; indices (tokens, k) the experts f_i counts (the
    built-in router passes the plain top-k of `scores`)."""
    k = indices.shape[1]
    groups = batch_size if per_sequence else 1
    scores = scores.reshape(groups, -1, num_experts)                                # (groups, T_g, E)
    chosen = torch.zeros_like(scores).scatter_(2, indices.reshape(groups, -1, k), 1.0)
    f = chosen.sum(1) / (scores.shape[1] * k)                                       # (groups, E)
    p = scores.mean(1)
    return num_experts * (f * p).sum(-1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1).square().mean()


@register_router("topk")
class TopKRouter(nn.Module):
    """The configurable top-k router (Mixtral, Qwen-MoE, DeepSeek-V3, GPT-OSS); see the module docstring."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = cfg.num_moe_experts
        self.num_experts, self.topk = E, cfg.moe_router_topk
        self.score_function, self.pre_softmax = cfg.moe_router_score_function, cfg.moe_router_pre_softmax
        self.num_groups, self.group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
        self.scaling_factor = cfg.moe_router_topk_scaling_factor
        self.fp32 = cfg.moe_router_dtype == "fp32"
        self.jitter_eps = cfg.moe_input_jitter_eps
        self.balancing = cfg.moe_router_load_balancing_type
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.bias_update_rate = cfg.moe_router_bias_update_rate
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(E)) if cfg.moe_router_add_bias else None
        # auxiliary-loss-free balancing: a bias added to the scores when picking, updated from load
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32) if cfg.moe_router_enable_expert_bias
                             else None)
        self.replay = RouterReplay()
        self.last_losses: dict[str, torch.Tensor] = {}  # detached terms of the last forward, for logging
        self.init_weights(cfg.init_method_std, cfg.init_method_std)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (tokens, hidden) -> (tokens, experts)."""
        if self.fp32:  # outside autocast, which would run the matmul in bf16 whatever the input dtype
            with torch.autocast(x.device.type, enabled=False):
                return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch_size = x.shape[0]
        x = x.reshape(-1, x.shape[-1])
        if self.training and self.jitter_eps:
            noise = torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            x = x * noise
        logits = self.logits(x)
        probs, indices, scores = self.route(logits)
        aux = logits.new_zeros(())
        self.last_losses = {}
        if self.balancing != "none" and self.aux_coeff:
            # f_i from the plain top-k of the unbiased scores, whatever bias, groups or replay picked
            counted = scores.detach().topk(self.topk, dim=-1).indices
            term = self.aux_coeff * load_balancing_loss(scores, counted, self.num_experts, batch_size,
                                                        per_sequence=self.balancing == "seq_aux_loss")
            self.last_losses["aux_loss"] = term.detach()
            aux = aux + term
        if self.z_coeff:
            term = self.z_coeff * z_loss(logits)
            self.last_losses["z_loss"] = term.detach()
            aux = aux + term
        return probs, indices, aux

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits (tokens, experts) -> (probs (tokens, k), indices (tokens, k), scores normalised over
        all experts for the balancing loss)."""
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
            if self.pre_softmax:
                indices = self._select(scores)
                probs = scores.gather(1, indices)
            else:
                indices = self._select(logits)
                probs = torch.softmax(logits.gather(1, indices), dim=-1)
        else:
            sig = torch.sigmoid(logits)
            indices = self._select(sig)
            probs = sig.gather(1, indices)
            if self.topk > 1:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
            scores = sig / (sig.sum(-1, keepdim=True) + 1e-20)
        if self.scaling_factor is not None:
            probs = probs * self.scaling_factor
        return probs, indices, scores

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        if self.expert_bias is not None:
            scores = scores + self.expert_bias
        choose = lambda s: topk_indices(s.detach(), self.topk, self.num_groups, self.group_topk)  # noqa: E731
        return self.replay.select(scores, choose)
