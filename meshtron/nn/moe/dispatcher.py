"""Token dispatchers: move each token to the experts its routing map names, and the results back.

The interface (`TokenDispatcher`) has two halves around the expert computation:
    dispatch(tokens (T, hidden), probs (T, E), routing_map (T, E) bool, row_bound=None)
        -> expert_input (N, hidden) grouped by this rank's experts in order,
           tokens_per_expert (num_local_experts,) long, handle
    combine(expert_output (N, hidden), handle) -> (T, hidden)
        out[t] = sum over experts e with routing_map[t, e] of probs[t, e] * expert_e(tokens[t])
Expert e's group is the tokens_per_expert[e] rows after those of experts < e; rows past the last
group (N may be larger: a buffer sized by `row_bound`, see below) are spare: the experts may compute
anything there and combine ignores them. A dispatcher that exchanges rows between ranks (all-gather,
all-to-all over the `ep` mesh axis, installed by meshtron/parallel/expert_parallel.py) returns rows
only for this rank's experts. `row_bound` (routing_map.RowBound, optional keyword) bounds the rows of
a map over T tokens, so a dispatcher can size its buffers without reading the map on the host. A
dispatcher may declare `host_reads`, its device-to-host reads per forward (MoELayer.host_sync_reasons).

`LocalDispatcher` serves every expert on this device with `permute`: a scatter of every map entry to
its row (expert-major, token order within an expert; each group starting at a multiple of `align`
rows, padded with weight-0 rows) and its inverse as an index_add, all plain autograd ops with static
shapes: no device-to-host sync when a row bound is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from meshtron.compat import grouped_mm_row_alignment


class TokenDispatcher(Protocol):
    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 row_bound: Optional[Callable[[int], int]] = None) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, expert_output: torch.Tensor, handle: Any) -> torch.Tensor: ...


@dataclass
class LocalHandle:
    token_ids: torch.Tensor  # (N,) source token of each expert-input row (any token for a spare row)
    weights: torch.Tensor    # (N,) its routing probability (0 for padding and spare rows)
    num_tokens: int


def permute(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, max_rows: Optional[int] = None,
            align: int = 1) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
    """Rows of `tokens` gathered expert by expert (token order within an expert), each expert's group
    padded to a multiple of `align` rows -> (rows (N, hidden), group sizes (E,), handle).

    N = max_rows + E (align - 1) when `max_rows` bounds the entries of the map (no host sync), else the
    exact padded total, read from the device (one sync)."""
    T, E = routing_map.shape
    by_expert = routing_map.t()                                     # (E, T): row-major order is expert-major
    sizes = by_expert.sum(1)
    if align > 1:
        sizes = (sizes + align - 1) // align * align
    rows = int(sizes.sum()) if max_rows is None else max_rows + E * (align - 1)
    starts = sizes.cumsum(0) - sizes                                # (E,) first row of each group
    dest = torch.where(by_expert, starts[:, None] + by_expert.cumsum(1) - 1, rows)  # (E, T); `rows`: not routed
    entry = torch.arange(T, device=tokens.device) * E + torch.arange(E, device=tokens.device)[:, None]  # t E + e
    source = torch.full((rows + 1,), T * E, dtype=torch.long, device=tokens.device)
    source = source.scatter_(0, dest.reshape(-1), entry.reshape(-1))[:rows]  # map entry of each row; T E: none
    token_ids = (source // E).clamp_(max=T - 1)                     # rows without an entry read the last token
    weights = torch.cat([probs.reshape(-1), probs.new_zeros(1)]).index_select(0, source)  # 0 for rows without one
    return tokens.index_select(0, token_ids), sizes, LocalHandle(token_ids, weights, T)


def unpermute(rows: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
    """Weight each row by its probability and sum the rows of each token: (N, hidden) -> (T, hidden)."""
    weighted = rows * handle.weights.to(rows.dtype).unsqueeze(-1)
    out = rows.new_zeros(handle.num_tokens, rows.shape[-1])
    return out.index_add(0, handle.token_ids, weighted)


class LocalDispatcher:
    """No expert parallelism: every expert is on this device."""

    host_reads = 0  # device-to-host reads per forward with a row bound (see MoELayer.host_sync_reasons)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 row_bound: Optional[Callable[[int], int]] = None) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
        max_rows = None if row_bound is None else row_bound(tokens.shape[0])
        return permute(tokens, probs, routing_map, max_rows, grouped_mm_row_alignment(tokens))

    def combine(self, expert_output: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        return unpermute(expert_output, handle)
