"""Context parallelism: the sequence of every micro-batch is split over the `cp` mesh axis.

Sharding (no communication): with P = cp ranks and load balancing, the sequence is cut into 2P equal
chunks and rank r keeps chunks r and 2P-1-r (zig-zag), so under a causal mask every rank has the same
number of visible (query, key) pairs; without it, rank r keeps the r-th contiguous 1/P. Every
(batch, seq) tensor of the micro-batch (tokens, labels, loss mask, document and position ids) is cut
the same way, so the loss of each rank covers its own tokens and the trainer sums losses and token
counts over dp x cp.

Model: everything but attention is per token and runs unchanged on the local tokens; RoPE/learned
positions use the GLOBAL positions of the kept tokens (or the packed position_ids). Attention goes
through `CPContext.attend`, i.e. ring attention (ring_attention.py: P2P hops of key/value blocks in
forward, of key/value blocks and their fp32 gradients in backward). Document ids are all-gathered over
cp once per micro-batch so that every rank can mask any key block.

Parameters are replicated over cp; each cp rank's gradient covers its own tokens, and FSDP's
reduce-scatter over dp_shard x cp sums them (trainer / parallel/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshtron.nn.context import PackedContext
from meshtron.parallel.ring_attention import RingLayout, ring_attention


def cp_segments(rank: int, size: int, seq_len: int, load_balance: bool) -> list[tuple[int, int]]:
    """(start, length) ranges of the global sequence that cp rank `rank` keeps, in local order."""
    if load_balance:
        if seq_len % (2 * size):
            raise ValueError(f"context parallel: sequence length {seq_len} must be divisible by 2 * cp = {2 * size} "
                             "(zig-zag chunks); change data.seq_length or parallel.cp")
        chunk = seq_len // (2 * size)
        return [(rank * chunk, chunk), ((2 * size - 1 - rank) * chunk, chunk)]
    if seq_len % size:
        raise ValueError(f"context parallel: sequence length {seq_len} must be divisible by cp = {size}; "
                         "change data.seq_length or parallel.cp")
    chunk = seq_len // size
    return [(rank * chunk, chunk)]


def global_indices(segments: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """(local_len,) long: the global index of each local token."""
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in segments])


class ContextParallel:
    """Cuts micro-batches along the sequence for this cp rank and builds the ring-attention context."""

    def __init__(self, cp_mesh: DeviceMesh, load_balance: bool = True):
        self.group = cp_mesh.get_group()
        self.rank, self.size = cp_mesh.get_local_rank(), cp_mesh.size()
        self.load_balance = load_balance

    def segments(self, seq_len: int) -> list[list[tuple[int, int]]]:
        return [cp_segments(r, self.size, seq_len, self.load_balance) for r in range(self.size)]

    def shard_batch(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keep this rank's part of every (batch, seq) tensor; anything else passes through."""
        seq_len = mb["input_ids"].shape[1]
        mine = cp_segments(self.rank, self.size, seq_len, self.load_balance)
        return {name: _take(t, mine, seq_len) for name, t in mb.items()}

    def context(self, mb: dict[str, torch.Tensor]) -> CPContext:
        """The context of a micro-batch already cut by `shard_batch` (collective over cp when it has document ids)."""
        tokens = mb["input_ids"]
        positions = mb.get("position_ids")
        if positions is None:
            positions = self.global_positions(tokens.shape[0], tokens.shape[1], tokens.device)
        return self.context_for(positions, mb.get("document_ids"))

    def global_positions(self, batch: int, local_len: int, device: torch.device) -> torch.Tensor:
        """(batch, local_len) global positions of this rank's tokens (an unpacked sample's positions)."""
        segments = cp_segments(self.rank, self.size, local_len * self.size, self.load_balance)
        return global_indices(segments, device).expand(batch, -1).contiguous()

    def context_for(self, positions: torch.Tensor, document_ids: Optional[torch.Tensor]) -> CPContext:
        """The context of this rank's tokens from their (batch, local_len) positions and document ids (a
        pipeline stage gets only these; collective over cp when there are document ids)."""
        segments = self.segments(positions.shape[1] * self.size)
        layout = RingLayout(self.group, self.rank, self.size, segments,
                            None if document_ids is None else self._gather(document_ids))
        return CPContext(positions=positions, document_ids=document_ids, layout=layout)

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every cp rank's (batch, local_len) tensor, in rank order."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return parts


def _take(t: torch.Tensor, segments: list[tuple[int, int]], seq_len: int) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] != seq_len:
        return t
    return torch.cat([t[:, start:start + length] for start, length in segments], dim=1)


@dataclass
class CPContext(PackedContext):
    """A PackedContext for this rank's tokens whose attention runs as ring attention over cp.

    positions / document_ids: (batch, local_len), this rank's tokens. attention_mask(window) describes
    what these queries may see among ALL keys of the sequence in global order: (batch or 1, 1, local_len, seq);
    keys held by one rank alone never suffice, so attention must go through `attend`.
    """

    layout: Optional[RingLayout] = field(default=None, repr=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               window_size: Optional[int] = None, sink_logits: Optional[torch.Tensor] = None,
               dropout: float = 0.0) -> torch.Tensor:
        """The attention_core.attend contract, over the whole sequence (see ring_attention.py)."""
        if dropout > 0:
            raise ValueError(f"model.attention_dropout: {dropout} is not supported with context parallelism "
                             "(parallel.cp > 1); set model.attention_dropout 0")
        return ring_attention(q, k, v, self.layout, scale=scale, window_size=window_size, sink_logits=sink_logits)

    def attention_mask(self, window_size: Optional[int] = None) -> torch.Tensor:
        if window_size not in self._masks:
            layout, device = self.layout, self.positions.device
            q_idx = global_indices(layout.segments[layout.rank], device)
            seq_len = sum(length for _, length in layout.segments[0]) * layout.size
            k_idx = torch.arange(seq_len, device=device)
            diff = q_idx[:, None] - k_idx[None, :]
            mask = (diff >= 0) if window_size is None else (diff >= 0) & (diff < window_size)
            mask = mask[None, None]
            if layout.document_ids is not None:
                docs = self._global_document_ids(seq_len)
                mask = mask & (self.document_ids[:, :, None] == docs[:, None, :])[:, None]
            self._masks[window_size] = mask
        return self._masks[window_size]

    def sdpa_mask(self, window_size: Optional[int] = None) -> dict[str, Any]:
        return {"attn_mask": self.attention_mask(window_size)}

    def _global_document_ids(self, seq_len: int) -> torch.Tensor:
        """(batch, seq) document ids in global order, from every rank's gathered local ids."""
        layout = self.layout
        first = layout.document_ids[0]
        docs = first.new_empty(first.shape[0], seq_len)
        for r in range(layout.size):
            docs[:, global_indices(layout.segments[r], first.device)] = layout.document_ids[r]
        return docs
