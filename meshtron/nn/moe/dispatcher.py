"""Token dispatchers: move each token to the experts its routing map names, and the results back.

The interface (`TokenDispatcher`) has two halves around the expert computation:
    dispatch(tokens (T, hidden), probs (T, E), routing_map (T, E) bool)
        -> expert_input (N, hidden) grouped by this rank's experts in order,
           tokens_per_expert (num_local_experts,) long, handle
    combine(expert_output (N, hidden), handle) -> (T, hidden)
        out[t] = sum over experts e with routing_map[t, e] of probs[t, e] * expert_e(tokens[t])
A dispatcher that exchanges rows between ranks (all-gather, all-to-all over the `ep` mesh axis,
installed by meshtron/parallel/expert_parallel.py) returns rows only for this rank's experts.

`LocalDispatcher` serves every expert on this device: a permutation (expert-major, token order within
an expert) and its inverse as an index_add, both plain autograd ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class TokenDispatcher(Protocol):
    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, expert_output: torch.Tensor, handle: Any) -> torch.Tensor: ...


@dataclass
class LocalHandle:
    token_ids: torch.Tensor  # (N,) source token of each expert-input row
    weights: torch.Tensor    # (N,) its routing probability
    num_tokens: int


def permute(tokens: torch.Tensor, probs: torch.Tensor,
            routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
    """Rows of `tokens` gathered expert by expert (token order within an expert)."""
    by_expert = routing_map.t()                                 # (E, T): row-major order is expert-major
    token_ids = by_expert.nonzero(as_tuple=True)[1]
    weights = probs.t().masked_select(by_expert)                # same order as token_ids
    handle = LocalHandle(token_ids, weights, tokens.shape[0])
    return tokens.index_select(0, token_ids), routing_map.sum(0), handle


def unpermute(rows: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
    """Weight each row by its probability and sum the rows of each token: (N, hidden) -> (T, hidden)."""
    weighted = rows * handle.weights.to(rows.dtype).unsqueeze(-1)
    out = rows.new_zeros(handle.num_tokens, rows.shape[-1])
    return out.index_add(0, handle.token_ids, weighted)


class LocalDispatcher:
    """No expert parallelism: every expert is on this device."""

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
        return permute(tokens, probs, routing_map)

    def combine(self, expert_output: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        return unpermute(expert_output, handle)
