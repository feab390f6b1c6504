"""Paged attention through FlexAttention: one call per layer for every token of the step (decodes and
prefill chunks together), reading keys and values from the cache through the block tables.

The layer's cache (num_blocks + 1, block_size, kv_heads, d) is viewed, without a copy, as one key
sequence of (num_blocks + 1) * block_size slots, (1, kv_heads, slots, d); the queries are the step's
packed row (1, heads, T, d). A `BlockMask` with key blocks of `block_size` slots (one cache block each)
lists, for each tile of Q_BLOCK_SIZE queries, the cache blocks its sequences attend: their block
tables from the window's first block to the block of the tile's last position. The kernel loads only
those blocks, each once per tile, so no key or value is gathered into a copy. Inside a listed block
`mask_mod` recovers the key's position: slot k lies in cache block k // bs, which is logical block
`block_logical[seq, k // bs]` of the query's sequence (-1 when the sequence does not hold it, as when
the tile's other sequences brought it in), so its position is that index * bs + k % bs; the key is seen
when its position is at most the query's and within the window. Blocks that every query of a
one-sequence tile sees whole are listed as full and skip `mask_mod`. Attention sinks use the
log-sum-exp flex returns: with a virtual key of logit s and value 0, out_sink = out * sigmoid(lse - s).

On CUDA the call is `torch.compile`d (flex's fused Triton kernels). On a CPU it runs eagerly: flex's
reference implementation, which scores every cache slot (and repeats K/V for grouped-query heads), so
it suits tests and small caches only; `engine.decode_attention: auto` never picks it on a CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from meshtron.compat import recompile_limit

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

# queries per BlockMask row tile: flex's default, a multiple of every tile its CUDA kernels use (a step of
# fewer queries is one tile, widened at the call to what flex's decoding kernel needs: `_query_tile`)
Q_BLOCK_SIZE = 128
# the window of layers without one: every position is within it (one mask_mod for all layers)
NO_WINDOW = 2**30
# flex's CUDA kernels read keys in tiles of >= 16 that must divide a BlockMask key block (a cache block)
MIN_CUDA_BLOCK = 16
# one compiled variant per (window, sinks, query-tile width, decode/prefill kernel, 1-or-more sizes): more than
# dynamo's default of 8, past which it would run flex's dense reference instead
RECOMPILE_LIMIT = 64

MaskTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PagedSequence:
    """One sequence of the step: its block table, the position of its first query, its query count."""

    block_ids: Sequence[int]
    start_pos: int
    num_tokens: int


@dataclass
class FlexPagedPlan:
    """A step's inputs to `flex_paged_attention`, built once and shared by every layer."""

    query_seq: torch.Tensor  # (T,) int32 sequence index of each packed query
    query_pos: torch.Tensor  # (T,) int32 position of each query in its sequence
    block_logical: torch.Tensor  # (sequences, num_blocks + 1) int32 logical index of a cache block; -1: not held
    block_size: int
    sequences: list[PagedSequence]
    _masks: dict[Optional[int], MaskTensors] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, sequences: list[PagedSequence], block_size: int, num_cache_blocks: int,
              device: torch.device) -> FlexPagedPlan:
        """num_cache_blocks: the cache tensors' first dimension (num_blocks + 1, with scratch)."""
        query_seq = np.concatenate([np.full(s.num_tokens, i, dtype=np.int32) for i, s in enumerate(sequences)])
        query_pos = np.concatenate([np.arange(s.start_pos, s.start_pos + s.num_tokens, dtype=np.int32)
                                    for s in sequences])
        held = [-(-(s.start_pos + s.num_tokens) // block_size) for s in sequences]
        tables = np.zeros((len(sequences), max(held)), dtype=np.int64)
        logical = np.full_like(tables, -1)
        for i, (s, n) in enumerate(zip(sequences, held)):
            tables[i, :n], logical[i, :n] = s.block_ids[:n], np.arange(n)
        # scattered on the device: only the step's block tables cross, not the (sequences, blocks) table
        tables_t, logical_t = (torch.from_numpy(a).to(device) for a in (tables, logical))
        block_logical = torch.full((len(sequences), num_cache_blocks), -1, dtype=torch.int32, device=device)
        block_logical.scatter_reduce_(1, tables_t, logical_t.to(torch.int32), reduce="amax")
        return cls(torch.from_numpy(query_seq).to(device), torch.from_numpy(query_pos).to(device), block_logical,
                   block_size, sequences)

    @property
    def num_tokens(self) -> int:
        return self.query_seq.shape[0]

    def mask_tensors(self, window_size: Optional[int]) -> MaskTensors:
        """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of the BlockMask, built once per
        window size: each (1, 1, tiles[, columns]) int32, indices being cache block ids."""
        if window_size not in self._masks:
            self._masks[window_size] = _block_lists(self.sequences, self.block_size, window_size,
                                                    self.block_logical.shape[1], self.query_seq.device)
        return self._masks[window_size]


def _block_lists(sequences: list[PagedSequence], bs: int, window_size: Optional[int], num_cache_blocks: int,
                 device: torch.device) -> MaskTensors:
    """Per tile of Q_BLOCK_SIZE queries: the cache blocks some query may see (partial) and those all see whole."""
    num_tokens = sum(s.num_tokens for s in sequences)
    starts = np.cumsum([0] + [s.num_tokens for s in sequences])
    partial: list[np.ndarray] = []
    full: list[np.ndarray] = []
    for lo in range(0, num_tokens, Q_BLOCK_SIZE):
        hi = min(num_tokens, lo + Q_BLOCK_SIZE)
        inside = [i for i in range(len(sequences)) if starts[i] < hi and starts[i + 1] > lo]
        tile_partial, tile_full = [], []
        for i in inside:
            s = sequences[i]
            first = s.start_pos + max(lo, starts[i]) - starts[i]  # the tile's first and last query position
            last = s.start_pos + min(hi, starts[i + 1]) - 1 - starts[i]
            lo_block = max(0, first - window_size + 1) // bs if window_size is not None else 0
            blocks = np.arange(lo_block, last // bs + 1)
            whole = np.zeros(len(blocks), dtype=bool)
            if len(inside) == 1:  # a tile shared with another sequence has no block all its queries see
                whole = (blocks + 1) * bs - 1 <= first
                if window_size is not None:
                    whole &= last - blocks * bs < window_size
            table = np.asarray(s.block_ids, dtype=np.int64)
            tile_partial.append(table[blocks[~whole]])
            tile_full.append(table[blocks[whole]])
        partial.append(np.unique(np.concatenate(tile_partial)))
        full.append(np.unique(np.concatenate(tile_full)))
    return (*_pack(partial, num_cache_blocks, device), *_pack(full, num_cache_blocks, device))


def _pack(lists: list[np.ndarray], num_cache_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-tile block lists -> counts (1, 1, tiles) and indices (1, 1, tiles, num_cache_blocks),
    zero-padded: flex sizes its key range by the index columns (only the ragged part crosses to the device)."""
    counts = np.array([len(x) for x in lists], dtype=np.int32)
    ragged = np.zeros((len(lists), max(1, int(counts.max()))), dtype=np.int32)
    for t, x in enumerate(lists):
        ragged[t, :len(x)] = x
    indices = torch.zeros(1, 1, len(lists), num_cache_blocks, dtype=torch.int32, device=device)
    indices[0, 0, :, :ragged.shape[1]] = torch.from_numpy(ragged).to(device)
    return torch.from_numpy(counts[None, None]).to(device), indices


def _paged_mask_mod(query_seq: torch.Tensor, query_pos: torch.Tensor, block_logical: torch.Tensor, bs: int,
                    window_size: int) -> Callable:
    def mask_mod(b, h, q_idx, kv_idx):
        logical = block_logical[query_seq[q_idx], kv_idx // bs]
        k_pos, q_pos = logical * bs + kv_idx % bs, query_pos[q_idx]
        return (logical >= 0) & (k_pos <= q_pos) & (q_pos - k_pos < window_size)

    return mask_mod


def _query_tile(num_tokens: int, group: int) -> int:
    """Queries per BlockMask row tile. flex's decoding kernel (steps of < 128 queries) puts all queries of
    a key head's group in one tile of next_pow2(T * group) rows, which must divide the BlockMask's; such a
    step is one tile whatever its width, so widening it changes no block list."""
    if num_tokens >= Q_BLOCK_SIZE:
        return Q_BLOCK_SIZE
    return max(Q_BLOCK_SIZE, 1 << max(0, num_tokens * group - 1).bit_length())


def _flex_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: MaskTensors, query_seq: torch.Tensor,
               query_pos: torch.Tensor, block_logical: torch.Tensor, bs: int, window_size: int, q_tile: int,
               scale: float, kernel_options: Optional[dict], with_lse: bool):
    """-> out, or with_lse (out, AuxOutput with the natural-log lse; flex's CPU kernel has none). The
    BlockMask is assembled here, so under torch.compile its tensors are graph inputs, not guards."""
    mask_mod = _paged_mask_mod(query_seq, query_pos, block_logical, bs, window_size)
    block_mask = BlockMask.from_kv_blocks(*masks, BLOCK_SIZE=(q_tile, bs), mask_mod=mask_mod,
                                          seq_lengths=(q.shape[2], k.shape[2]), compute_q_blocks=False)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          return_aux=AuxRequest(lse=True) if with_lse else None, kernel_options=kernel_options)


_compiled: Optional[Callable] = None


def compiled_flex_call() -> Callable:
    """`_flex_call` compiled once per process (shapes change every step: dynamic after the first)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_flex_call, fullgraph=True)
    return _compiled


def cuda_kernel_options(block_size: int) -> dict:
    """The CUDA kernels' key tile: the largest of 64, 32, 16 dividing a cache block (see MIN_CUDA_BLOCK)."""
    return {"BLOCK_N": next(n for n in (64, 32, MIN_CUDA_BLOCK) if block_size % n == 0)}


def unavailable_reason(block_size: int, device: torch.device) -> Optional[str]:
    """Why flex cannot serve this engine (None: it can)."""
    if device.type == "cuda" and block_size % MIN_CUDA_BLOCK:
        return (f"flex's CUDA kernels need engine.block_size to be a multiple of {MIN_CUDA_BLOCK} "
                f"(it is {block_size})")
    return None


def flex_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: FlexPagedPlan,
                         window_size: Optional[int], scale: float, sink_logits: Optional[torch.Tensor] = None,
                         compiled: bool = False) -> torch.Tensor:
    """q (1, heads, T, dk); caches (num_blocks + 1, block_size, kv_heads, d); sink_logits (heads,) or None
    -> (1, heads, T, dv). Query head h reads kv head h // (heads // kv_heads)."""
    slots, bs = k_cache.shape[0] * k_cache.shape[1], plan.block_size
    k = k_cache.view(1, slots, *k_cache.shape[2:]).transpose(1, 2)  # (1, kv_heads, slots, dk), a view
    v = v_cache.view(1, slots, *v_cache.shape[2:]).transpose(1, 2)
    args = (q, k, v, plan.mask_tensors(window_size), plan.query_seq, plan.query_pos, plan.block_logical, bs,
            NO_WINDOW if window_size is None else window_size, _query_tile(q.shape[2], q.shape[1] // k.shape[1]),
            scale, cuda_kernel_options(bs) if q.is_cuda else None, sink_logits is not None)
    if compiled:
        with recompile_limit(RECOMPILE_LIMIT):
            result = compiled_flex_call()(*args)
    else:
        with warnings.catch_warnings():  # the eager reference is chosen knowingly (CPU, tests)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            result = _flex_call(*args)
    if sink_logits is None:
        return result
    out, aux = result
    keep = torch.sigmoid(aux.lse - sink_logits.to(aux.lse.dtype).view(1, -1, 1))  # (1, heads, T)
    return out * keep[..., None].to(out.dtype)


class FlexPagedAttention:
    """`engine.decode_attention: flex` for the varlen layout: a step's plan, then one call per layer."""

    def __init__(self, compiled: bool):
        self.compiled = compiled

    def plan(self, sequences: list[PagedSequence], block_size: int, num_cache_blocks: int,
             device: torch.device) -> FlexPagedPlan:
        return FlexPagedPlan.build(sequences, block_size, num_cache_blocks, device)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: FlexPagedPlan,
                 window_size: Optional[int], scale: float, sink_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        return flex_paged_attention(q, k_cache, v_cache, plan, window_size, scale, sink_logits, self.compiled)
