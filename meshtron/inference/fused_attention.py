"""Decode attention that reads keys and values through the block table, for `torch.compile`.

The eager decode path (`varlen_context.VarlenPagedContext.attend`) gathers each bucket's key/value
blocks into new tensors and then runs `scaled_dot_product_attention` on them: the gather copies as
many bytes as attention reads, every layer of every step. Written as below (an indexed load, then
products summed over the head dimension, a softmax over the keys, and products summed over the
keys), inductor turns the whole function into loops that load each key and value straight from the
cache through the block table, so nothing is gathered. `engine.decode_attention: compiled` switches
the engine's decode buckets to the compiled function (compiled once, with dynamic shapes: the
bucket's row and block counts change every step). Run eagerly the same function is correct but
slow (it materialises the products); tests check it against the SDPA path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_blocks: torch.Tensor,
                           bias: torch.Tensor, scale: float) -> torch.Tensor:
    """q (rows, heads, 1, dk); caches (num_blocks + 1, block_size, kv_heads, d); key_blocks (rows, blocks);
    bias (rows, 1, 1, blocks * block_size), additive (0 or -inf) -> (rows, heads, 1, dv). Query head h
    reads kv head h // (heads // kv_heads), as grouped-query attention does."""
    rows, blocks = key_blocks.shape
    block_size, kv_heads, dk = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    dv = v_cache.shape[3]
    group = q.shape[1] // kv_heads
    k = k_cache[key_blocks]  # (rows, blocks, block_size, kv_heads, dk)
    v = v_cache[key_blocks]
    qg = q.reshape(rows, 1, 1, kv_heads, group, dk)
    scores = (qg * k[:, :, :, :, None, :]).sum(-1) * scale  # (rows, blocks, block_size, kv_heads, group)
    scores = scores.reshape(rows, blocks * block_size, kv_heads, group) + bias.reshape(rows, blocks * block_size, 1, 1)
    probs = torch.softmax(scores, dim=1).reshape(rows, blocks, block_size, kv_heads, group, 1)
    out = (probs * v[:, :, :, :, None, :]).sum((1, 2))  # (rows, kv_heads, group, dv)
    return out.reshape(rows, kv_heads * group, 1, dv)


_compiled: Optional[Callable[..., torch.Tensor]] = None


def compiled_paged_decode_attention() -> Callable[..., torch.Tensor]:
    """The compiled function (one per process; inductor compiles on the first call, ~15 s on a CPU)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(paged_decode_attention, dynamic=True, fullgraph=True)
    return _compiled


def compiled_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group,
                              window_size: Optional[int], scale: float) -> torch.Tensor:
    """A decode bucket (`varlen_context.AttentionGroup`) through the compiled function."""
    bias = group.bias(k_cache.shape[1], window_size, q.dtype)
    return compiled_paged_decode_attention()(q, k_cache, v_cache, group.key_blocks, bias, scale)
