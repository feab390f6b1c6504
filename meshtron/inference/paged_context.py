"""The paged attention context: keys/values live in block-addressed cache tensors, read back through
block tables, for a batch that mixes prefill chunks and decodes.

Layouts (the runner picks one per step, see `runner.choose_layout`):
- packed: every scheduled token in one row (batch 1). Keys are the concatenation of each
  sequence's whole context, and the mask keeps sequences apart (a query sees only keys of its own
  sequence, causally, within the layer's window). No padding, but attention work is
  tokens x all keys, so it suits a few long prefill chunks.
- rows of S: each sequence's chunk is cut into segments of at most S tokens, one row each, queries
  padded to S and keys to the longest context. A decode is a row of one token; a prefill chunk of
  n tokens is ceil(n / S) rows. All new keys/values are written before any are read, so a segment
  sees the earlier segments of its own chunk. S = 1 wastes nothing on padding and suits a step of
  decodes plus a short prefill; S = the longest chunk is "one row per sequence".
Both satisfy the interface of `meshtron.nn.context`: `positions` (rows, q), `rope`,
`update_kv(layer_id, k, v)` and `attention_mask` / `sdpa_mask`.

Slots: token position p of a sequence with block table B lives at slot p % bs of block B[p // bs]
of each layer's cache tensor (num_blocks + 1, bs, kv_heads, head_dim). Keys are read back a whole
block at a time (one contiguous copy per block, several times faster than gathering slot by slot);
key positions past a sequence's length are masked. The extra last block is scratch: padding
writes land in it and padded key blocks read it (masked out). A padding query attends only its
row's first key, so it stays finite and never spreads NaNs into real rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from meshtron.inference.scheduler import ScheduledChunk

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


class PagedKVCache:
    """Per-layer key and value tensors (num_blocks + 1, block_size, kv_heads, dim), allocated on first
    use so their head count and width come from the layer itself (tensor-parallel shards, MLA's
    wider keys)."""

    def __init__(self, num_blocks: int, block_size: int, device: torch.device):
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * block_size  # the scratch block's first slot
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k (rows, kv_heads, q, dk), v (rows, kv_heads, q, dv) only give shapes and dtype."""
        if layer_id not in self.layers:
            self.layers[layer_id] = tuple(
                torch.zeros(self.num_blocks + 1, self.block_size, t.shape[1], t.shape[3], dtype=t.dtype,
                            device=self.device) for t in (k, v))
        return self.layers[layer_id]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers.values() for t in pair)

    def release(self) -> None:
        self.layers.clear()


@dataclass
class PagedContext:
    positions: torch.Tensor  # (rows, q) long
    write_slots: torch.Tensor  # (rows * q,) cache slot of each query token; padding -> scratch slot
    key_blocks: torch.Tensor  # (rows, k // bs) cache block of each run of bs keys; padding -> scratch block
    key_positions: torch.Tensor  # (rows, k) position of each key in its sequence
    key_seq: torch.Tensor  # (rows, k) which sequence of the batch a key belongs to; padding and past-the-end -1
    query_seq: torch.Tensor  # (rows, q) which sequence a query belongs to; padding -1
    cache: PagedKVCache
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    _masks: dict[Optional[int], torch.Tensor] = field(default_factory=dict, repr=False)

    def update_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k, v (rows, kv_heads, q, d) into the cache; return every key/value the rows
        attend: (rows, kv_heads, k, d), in `key_blocks` order."""
        k_cache, v_cache = self.cache.layer(layer_id, k, v)
        rows, num_key_blocks = self.key_blocks.shape
        out = []
        for cache, new in ((k_cache, k), (v_cache, v)):
            slots = cache.view(-1, *cache.shape[2:])  # (num_slots, kv_heads, d)
            slots.index_copy_(0, self.write_slots, new.transpose(1, 2).reshape(-1, *cache.shape[2:]))
            gathered = cache.index_select(0, self.key_blocks.reshape(-1))  # (rows * blocks, bs, kv_heads, d)
            out.append(gathered.view(rows, num_key_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2))
        return out[0], out[1]

    def attention_mask(self, window_size: Optional[int] = None) -> torch.Tensor:
        """Boolean (rows, 1, q, k): same sequence, causal, within the window; padding sees key 0."""
        if window_size not in self._masks:
            q_pos, k_pos = self.positions[:, :, None], self.key_positions[:, None, :]
            mask = (self.query_seq[:, :, None] == self.key_seq[:, None, :]) & (k_pos <= q_pos)
            if window_size is not None:
                mask = mask & (q_pos - k_pos < window_size)
            pad_query = (self.query_seq < 0)[:, :, None]
            first_key = torch.zeros_like(mask[:1, :1])
            first_key[..., 0] = True
            self._masks[window_size] = (mask | (pad_query & first_key))[:, None]
        return self._masks[window_size]

    def sdpa_mask(self, window_size: Optional[int] = None) -> dict[str, Any]:
        return {"attn_mask": self.attention_mask(window_size)}


@dataclass
class PagedBatch:
    """The model input of one step: tokens (rows, q), its context, and where to read the logits."""

    tokens: torch.Tensor
    ctx: PagedContext
    sample_index: torch.Tensor  # (num_sampling,) flat index into rows * q of each sampled sequence's last token
    sample_req_ids: list[str]
    token_index: list[np.ndarray] = field(default_factory=list)  # per chunk: flat index of each of its tokens


def _segments(i: int, c: ScheduledChunk, bs: int, max_len: Optional[int]) -> list[tuple]:
    """The chunk cut into (seq index, chunk, query positions, key end, key blocks, query slots, token
    ids, samples) pieces of at most `max_len` tokens (None: one piece)."""
    n = len(c.token_ids)
    step = n if max_len is None else max_len
    table = np.asarray(c.block_ids, dtype=np.int64)
    pieces = []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        q_pos = np.arange(c.start_pos + lo, c.start_pos + hi)
        end = c.start_pos + hi
        pieces.append((i, c, q_pos, end, table[: -(-end // bs)], table[q_pos // bs] * bs + q_pos % bs,
                       c.token_ids[lo:hi], c.samples and hi == n))
    return pieces


def build_paged_batch(chunks: list[ScheduledChunk], cache: PagedKVCache, layout: str,
                      segment_len: Optional[int] = None, num_rows: Optional[int] = None,
                      num_key_blocks: Optional[int] = None, num_tokens: Optional[int] = None) -> PagedBatch:
    """Lay out the step's chunks as `layout`: 'packed', or 'rows' of at most `segment_len` tokens
    (None: one row per sequence). For fixed shapes (CUDA graphs) num_rows / num_key_blocks pad the
    rows further; in the packed layout num_tokens / num_key_blocks pad its one row."""
    bs = cache.block_size
    if layout == "packed":
        seqs = [p for i, c in enumerate(chunks) for p in _segments(i, c, bs, None)]
        groups = [seqs]
        num_q = max(num_tokens or 0, sum(len(s[2]) for s in seqs))
        num_kb = max(num_key_blocks or 0, sum(len(s[4]) for s in seqs))
    else:
        seqs = [p for i, c in enumerate(chunks) for p in _segments(i, c, bs, segment_len)]
        groups = [[s] for s in seqs] + [[] for _ in range((num_rows or len(seqs)) - len(seqs))]
        num_q = max(len(s[2]) for s in seqs)
        num_kb = max(num_key_blocks or 0, max(len(s[4]) for s in seqs))
    rows = len(groups)
    tokens = np.zeros((rows, num_q), dtype=np.int64)
    positions = np.zeros((rows, num_q), dtype=np.int64)
    write_slots = np.full((rows, num_q), cache.scratch_slot, dtype=np.int64)
    query_seq = np.full((rows, num_q), -1, dtype=np.int64)
    key_blocks = np.full((rows, num_kb), cache.scratch_block, dtype=np.int64)
    key_positions = np.zeros((rows, num_kb * bs), dtype=np.int64)
    key_seq = np.full((rows, num_kb * bs), -1, dtype=np.int64)
    sample_index, sample_req_ids = [], []
    token_index: list[list[np.ndarray]] = [[] for _ in chunks]
    for r, group in enumerate(groups):
        q_at = kb_at = 0
        for i, c, q_pos, end, table, q_slots, token_ids, samples in group:
            q_end, kb_end = q_at + len(q_pos), kb_at + len(table)
            tokens[r, q_at:q_end] = token_ids
            positions[r, q_at:q_end], write_slots[r, q_at:q_end], query_seq[r, q_at:q_end] = q_pos, q_slots, i
            key_blocks[r, kb_at:kb_end] = table
            key_positions[r, kb_at * bs:kb_end * bs] = np.arange(len(table) * bs)
            key_seq[r, kb_at * bs:kb_at * bs + end] = i  # slots past the sequence's end stay -1
            if samples:
                sample_index.append(r * num_q + q_end - 1)
                sample_req_ids.append(c.req_id)
            token_index[i].append(np.arange(r * num_q + q_at, r * num_q + q_end))
            q_at, kb_at = q_end, kb_end

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(cache.device, non_blocking=True)

    ctx = PagedContext(positions=t(positions), write_slots=t(write_slots.reshape(-1)), key_blocks=t(key_blocks),
                       key_positions=t(key_positions), key_seq=t(key_seq), query_seq=t(query_seq), cache=cache)
    return PagedBatch(t(tokens), ctx, t(np.asarray(sample_index, dtype=np.int64)), sample_req_ids,
                      [np.concatenate(parts) for parts in token_index])
