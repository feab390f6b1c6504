"""From a router's top-k choice to the (tokens, experts) routing map the dispatcher moves tokens by:
capacity limits (token dropping) and padding for quantization alignment.

The map is a boolean (tokens, experts) with its probabilities (tokens, experts), zero off the map.
    capacity   C = ceil(T k / E * capacity_factor); an expert chosen by more than C tokens keeps C of
               them: the C with the highest probability (policy "probs") or the first C in token order
               ("position"). Dropped choices contribute nothing; with no factor every choice is kept.
    padding    each expert's token count is raised to a multiple of `alignment` by adding tokens that
               did not choose it, with probability 0: quantized grouped GEMMs get aligned groups and the
               output is unchanged (0 * y adds nothing). An expert is padded with the first tokens not
               on its map; a batch with fewer such tokens than needed pads as far as it has them.
    row bound  R(T) = min(T E, min(T k, E C) + E (alignment - 1)): the most entries such a map over T
               tokens can hold, known without reading the map, so dispatchers can size their buffers
               without a device-to-host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class RoutingMap:
    routing_map: torch.Tensor     # (tokens, experts) bool: the token goes to the expert
    probs: torch.Tensor           # (tokens, experts): its weight there (0 for padding)
    num_chosen: int               # top-k choices made (tokens * k)
    num_dropped: torch.Tensor     # () choices dropped by capacity
    tokens_per_expert: torch.Tensor  # (experts,) choices per expert before dropping (the router's demand)


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


@dataclass(frozen=True)
class RowBound:
    """The most (token, expert) entries a routing map built by `build_routing_map` with these settings
    holds for `num_tokens` tokens (a static upper bound; the map itself may hold fewer)."""

    topk: int
    num_experts: int
    capacity_factor: Optional[float] = None
    pad_alignment: Optional[int] = None

    def __call__(self, num_tokens: int) -> int:
        rows = num_tokens * self.topk
        if self.capacity_factor is not None:
            rows = min(rows, self.num_experts * expert_capacity(num_tokens, self.topk, self.num_experts,
                                                                self.capacity_factor))
        if self.pad_alignment:
            rows = min(num_tokens * self.num_experts, rows + self.num_experts * (self.pad_alignment - 1))
        return rows


def build_routing_map(probs: torch.Tensor, indices: torch.Tensor, num_experts: int,
                      capacity_factor: Optional[float] = None, drop_policy: str = "probs",
                      pad_alignment: Optional[int] = None) -> RoutingMap:
    """probs, indices (tokens, k) -> RoutingMap after capacity dropping and padding."""
    tokens, k = indices.shape
    chosen = torch.zeros(tokens, num_experts, dtype=torch.bool, device=indices.device).scatter_(1, indices, True)
    prob_map = torch.zeros(tokens, num_experts, dtype=probs.dtype, device=probs.device).scatter(1, indices, probs)
    demand = chosen.sum(0)
    kept = chosen
    if capacity_factor is not None:
        kept = _within_capacity(chosen, prob_map, expert_capacity(tokens, k, num_experts, capacity_factor), drop_policy)
        prob_map = prob_map * kept
    routing_map = _pad(kept, pad_alignment) if pad_alignment else kept
    return RoutingMap(routing_map, prob_map, tokens * k, demand.sum() - kept.sum(), demand)


def _within_capacity(chosen: torch.Tensor, prob_map: torch.Tensor, capacity: int, policy: str) -> torch.Tensor:
    if policy == "position":
        return chosen & (chosen.cumsum(0) <= capacity)
    capacity = min(capacity, chosen.shape[0])
    ranked = prob_map.detach().masked_fill(~chosen, float("-inf"))
    top = ranked.topk(capacity, dim=0).indices                      # (capacity, experts)
    keep = torch.zeros_like(chosen).scatter_(0, top, True)
    return keep & chosen


def _pad(routing_map: torch.Tensor, alignment: int) -> torch.Tensor:
    counts = routing_map.sum(0)
    missing = (-counts) % alignment                                 # (experts,)
    free = ~routing_map
    rank_among_free = free.cumsum(0)                                # 1-based rank of each free token
    return routing_map | (free & (rank_among_free <= missing))
