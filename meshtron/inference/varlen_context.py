"""Variable-length paged attention: every scheduled token in one packed row, attention computed per
group of sequences straight from the paged cache.

The rows layouts of `paged_context` pad: queries to the longest segment and every row's keys to the
longest context of the step. Here the linear layers see exactly the step's tokens (one row of T),
and attention is split by the context's own `attend` (see `nn.attention_core.attend`):
- decodes (one new token each) are sorted by context length and cut into buckets whose lengths are
  within a factor `BUCKET_RATIO` of each other; each bucket gathers its key/value blocks, padded only
  to the bucket's longest context, and runs one batched attention with queries of length 1;
- each prefill chunk attends alone to its own blocks (causal from its start position).
With a `decode_attention` function (engine.decode_attention compiled or native; native is the CPU default) the
decodes form one bucket, which calls that function on the cache tensors and block table instead of
gathering (see `fused_attention`, `native_attention`): the compiled kernel's padded key blocks all
read the one scratch block, which stays in the CPU cache, the native kernel skips them, and one call
per layer costs less than several (measured ~10% faster end to end than buckets at BUCKET_RATIO).
With `flex` (engine.decode_attention flex, the CUDA default) there are no groups: every token of the
step, decodes and prefill chunks alike, goes through one FlexAttention call per layer that reads the
cache through the block tables (`flex_paged_attention`), sinks included.
`update_kv` writes the new keys/values into their slots and hands back the layer's cache tensors,
which `attend` reads through the groups' block tables. Groups, block indices and masks are built
once per step and shared by every layer; masks are cached per window size. Mamba layers get their
per-request states through `mamba_states` (see `mamba_state.MambaStepGroups`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from meshtron.inference.flex_paged_attention import FlexPagedAttention, FlexPagedPlan, PagedSequence
from meshtron.inference.mamba_state import MambaStateCache, MambaStepGroups
from meshtron.inference.paged_context import PagedBatch, PagedKVCache
from meshtron.inference.scheduler import ScheduledChunk
from meshtron.nn.attention_core import sink_attention
from meshtron.nn.context import RecurrentState

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

# A decode joins the current bucket while its context needs at least this share of the bucket's
# longest context (in blocks): at most 1 - ratio of a bucket's key reads are padding.
BUCKET_RATIO = 0.75


@dataclass
class AttentionGroup:
    """Sequences attended together: their query indices in the packed row, their key blocks
    (rows, blocks) padded with the scratch block, and per row the query positions."""

    query_index: torch.Tensor  # (rows * q,) flat query indices into the packed row
    key_blocks: torch.Tensor  # (rows, blocks)
    query_positions: torch.Tensor  # (rows, q)
    contiguous: Optional[tuple[int, int]] = None  # (lo, hi) when the queries are one slice of the row
    whole_row: bool = False  # decodes: the queries are the whole row, in order (query_index = arange(T))
    _masks: dict[Optional[int], torch.Tensor] = field(default_factory=dict, repr=False)
    _biases: dict[tuple[Optional[int], torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)
    # the native kernel's checked (key_blocks, lo, hi), per window and cache layout (`native_attention`)
    native_indices: dict[tuple, tuple[torch.Tensor, ...]] = field(default_factory=dict, repr=False)

    def bias(self, block_size: int, window_size: Optional[int], dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive bias (0 where allowed, -inf elsewhere), built once per step and
        shared by every layer: CPU attention kernels take a float bias about twice as fast as a
        boolean mask (which they convert on every call). Every row keeps key 0, so none is all -inf."""
        key = (window_size, dtype)
        if key not in self._biases:
            allowed = self.mask(block_size, window_size)
            self._biases[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf"))
        return self._biases[key]

    def key_range(self, window_size: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Decodes: (rows,) first and last key position each row attends (its window, or from 0)."""
        hi = self.query_positions[:, -1]
        return (hi - window_size + 1).clamp_(min=0) if window_size is not None else torch.zeros_like(hi), hi

    def mask(self, block_size: int, window_size: Optional[int]) -> torch.Tensor:
        """Boolean (rows, 1, q, keys): causal (so never past the sequence's end) and within the window.
        Padded key blocks lie past every query position, so they are masked too."""
        if window_size not in self._masks:
            rows, blocks = self.key_blocks.shape
            k_pos = torch.arange(blocks * block_size, device=self.key_blocks.device)[None, None, :]
            q_pos = self.query_positions[:, :, None]
            mask = k_pos <= q_pos
            if window_size is not None:
                mask = mask & (q_pos - k_pos < window_size)
            self._masks[window_size] = mask[:, None]
        return self._masks[window_size]


@dataclass
class VarlenPagedContext:
    positions: torch.Tensor  # (1, T)
    write_slots: torch.Tensor  # (T,)
    groups: list[AttentionGroup]
    cache: PagedKVCache
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    mamba: Optional[MambaStepGroups] = None
    # (q, k_cache, v_cache, group, window_size, scale) -> out for decode buckets (fused_attention,
    # native_attention); None: gather + SDPA
    decode_attention: Optional[Callable[..., torch.Tensor]] = None
    # engine.decode_attention flex: the step's plan and the function every layer calls with it (no groups)
    flex: Optional[tuple[FlexPagedAttention, FlexPagedPlan]] = None

    def mamba_states(self, layer_id: int) -> Optional[list[RecurrentState]]:
        return self.mamba.states(layer_id) if self.mamba is not None else None

    def update_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (1, kv_heads, T, d) into their slots; return this layer's cache tensors
        (num_blocks + 1, block_size, kv_heads, d), which `attend` reads through the block tables."""
        k_cache, v_cache = self.cache.layer(layer_id, k, v)
        for cache, new in ((k_cache, k), (v_cache, v)):
            cache.view(-1, *cache.shape[2:]).index_copy_(0, self.write_slots, new[0].transpose(0, 1))
        return k_cache, v_cache

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, scale: float,
               window_size: Optional[int] = None, sink_logits: Optional[torch.Tensor] = None,
               dropout: float = 0.0) -> torch.Tensor:
        """q (1, heads, T, dk) -> (1, heads, T, dv), each group attending to its own keys."""
        if self.flex is not None:
            attention, plan = self.flex
            return attention(q, k_cache, v_cache, plan, window_size, scale, sink_logits)
        heads, bs = q.shape[1], self.cache.block_size
        if len(self.groups) == 1 and self.groups[0].whole_row and self.decode_attention is not None \
                and sink_logits is None:  # a step of decodes only (batch-1 decode): no gather, no scatter
            o = self.decode_attention(q[0].transpose(0, 1)[:, :, None], k_cache, v_cache, self.groups[0], window_size,
                                      scale)  # (T, heads, 1, dv)
            return o[:, :, 0].transpose(0, 1)[None]
        out = q.new_empty(1, heads, q.shape[2], v_cache.shape[-1])
        for g in self.groups:
            rows, blocks = g.key_blocks.shape
            if g.contiguous is not None:
                lo, hi = g.contiguous
                q_g = q[:, :, lo:hi]
            else:  # decodes: one query per row
                q_g = q[0].index_select(1, g.query_index).transpose(0, 1)[:, :, None]  # (rows, heads, 1, dk)
                if self.decode_attention is not None and sink_logits is None:
                    o = self.decode_attention(q_g, k_cache, v_cache, g, window_size, scale)
                    out[0].index_copy_(1, g.query_index, o[:, :, 0].transpose(0, 1))
                    continue
            flat = g.key_blocks.reshape(-1)
            k_g, v_g = (c.index_select(0, flat).view(rows, blocks * bs, *c.shape[2:]).transpose(1, 2)
                        for c in (k_cache, v_cache))  # (rows, kv_heads, keys, d)
            if sink_logits is None:
                o = F.scaled_dot_product_attention(q_g, k_g, v_g, attn_mask=g.bias(bs, window_size, q.dtype),
                                                   scale=scale, enable_gqa=heads != k_g.shape[1])
            else:
                o = sink_attention(q_g, k_g, v_g, g.mask(bs, window_size), sink_logits, scale=scale)
            if g.contiguous is not None:
                out[:, :, lo:hi] = o
            else:
                out[0].index_copy_(1, g.query_index, o[:, :, 0].transpose(0, 1))
        return out


def _decode_buckets(lengths: list[int], ratio: float = BUCKET_RATIO) -> list[list[int]]:
    """Indices into `lengths` (key blocks per decode) grouped so that each bucket's shortest context is
    at least `ratio` of its longest (0: one bucket)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and lengths[i] >= ratio * lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def build_varlen_batch(chunks: list[ScheduledChunk], cache: PagedKVCache,
                       states: Optional[MambaStateCache] = None,
                       decode_attention: Optional[Callable[..., torch.Tensor]] = None) -> PagedBatch:
    """One packed row of every chunk's tokens, with decode buckets and per-chunk prefill groups, or with
    a `FlexPagedAttention` its plan instead (and, with `states`, the Mamba state groups)."""
    bs, device = cache.block_size, cache.device
    flex = isinstance(decode_attention, FlexPagedAttention)
    tokens, positions, slots, sample_index, sample_req_ids = [], [], [], [], []
    starts, decodes, groups = [], [], []
    at = 0
    for c in chunks:
        n = len(c.token_ids)
        pos = np.arange(c.start_pos, c.start_pos + n)
        table = np.asarray(c.block_ids, dtype=np.int64)
        tokens.append(np.asarray(c.token_ids, dtype=np.int64))
        positions.append(pos)
        slots.append(table[pos // bs] * bs + pos % bs)
        if c.samples:
            sample_index.append(at + n - 1)
            sample_req_ids.append(c.req_id)
        starts.append(at)
        if n == 1 and not flex:
            decodes.append(len(starts) - 1)
        elif not flex:  # flex has no groups: its plan below covers every chunk
            blocks = table[: -(-(c.start_pos + n) // bs)]
            groups.append(AttentionGroup(
                query_index=torch.arange(at, at + n, device=device),
                key_blocks=torch.from_numpy(blocks[None].copy()).to(device),
                query_positions=torch.from_numpy(pos[None]).to(device), contiguous=(at, at + n)))
        at += n
    if decodes:
        needed = [-(-(chunks[i].start_pos + 1) // bs) for i in decodes]
        for bucket in _decode_buckets(needed, 0.0 if decode_attention is not None else BUCKET_RATIO):
            width = needed[bucket[0]]
            key_blocks = np.full((len(bucket), width), cache.scratch_block, dtype=np.int64)
            for r, j in enumerate(bucket):
                key_blocks[r, : needed[j]] = chunks[decodes[j]].block_ids[: needed[j]]
            members = [decodes[j] for j in bucket]
            groups.append(AttentionGroup(
                query_index=torch.tensor([starts[i] for i in members], device=device),
                key_blocks=torch.from_numpy(key_blocks).to(device),
                query_positions=torch.tensor([[chunks[i].start_pos] for i in members], device=device),
                whole_row=[starts[i] for i in members] == list(range(at))))

    def t(parts: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)

    mamba = MambaStepGroups.build(chunks, starts, states) if states is not None else None
    ctx = VarlenPagedContext(positions=t(positions)[None], write_slots=t(slots), groups=groups, cache=cache,
                             mamba=mamba, decode_attention=None if flex else decode_attention)
    if flex:
        sequences = [PagedSequence(c.block_ids, c.start_pos, len(c.token_ids)) for c in chunks]
        ctx.flex = (decode_attention, decode_attention.plan(sequences, bs, cache.num_blocks + 1, device))
    token_index = [np.arange(at, at + len(c.token_ids)) for at, c in zip(starts, chunks)]
    return PagedBatch(t(tokens)[None], ctx, torch.tensor(sample_index, dtype=torch.long, device=device),
                      sample_req_ids, token_index)
