"""Causal self-attention with grouped-query heads, optional QK-norm, RoPE, biases, windows and sinks.

q = x Wq, k = x Wk, v = x Wv (num_kv_heads <= num_heads; one kv head is MQA), each query/key head
optionally normalised (QK-norm), then rotated by position, then
    out = softmax(scale * q k^T + mask [+ sink column]) v,   y = out Wo
where the mask is causal (and same-document, and a sliding window of `window_size` keys when set)
and scale defaults to 1/sqrt(head_dim). The product itself lives in `attention_core.attend`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from meshtron.nn.attention_core import attend
from meshtron.nn.context import MixerContext
from meshtron.nn.norm import build_norm
from meshtron.nn.rotary import apply_rotary

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 layer_id: int, qkv_bias: bool = False, out_bias: bool = False, dropout: float = 0.0,
                 qk_norm: Optional[str] = None, norm_eps: float = 1e-5, softmax_type: str = "vanilla",
                 softmax_scale: Optional[float] = None, window_size: Optional[int] = None,
                 rotary_interleaved: bool = False, attention_backend: str = "auto"):
        """qk_norm: None or a norm kind ('RMSNorm', 'LayerNorm') applied per head to queries and keys;
        attention_backend: auto, sdpa or flex (attention_core.attend)."""
        super().__init__()
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type {softmax_type!r}; choose one of {SOFTMAX_TYPES}")
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dropout = dropout
        self.scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
        self.window_size, self.softmax_type, self.rotary_interleaved = window_size, softmax_type, rotary_interleaved
        self.attention_backend = attention_backend
        self.wq = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(num_heads * head_dim, hidden_size, bias=out_bias)
        self.q_norm = build_norm(qk_norm, head_dim, norm_eps) if qk_norm else None
        self.k_norm = build_norm(qk_norm, head_dim, norm_eps) if qk_norm else None
        # A learnable sink logit per head starts at 0, i.e. where off-by-one keeps it.
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if softmax_type == "learnable" else None

    def sink_logits(self, q: torch.Tensor) -> Optional[torch.Tensor]:
        """(local heads,) sink logits, or None for the vanilla softmax."""
        if self.softmax_type == "vanilla":
            return None
        if self.sinks is None:
            return q.new_zeros(q.shape[1], dtype=torch.float32)
        # Under tensor parallelism the sinks are split by head like the queries: use this rank's share.
        return self.sinks.to_local() if hasattr(self.sinks, "to_local") else self.sinks

    def forward(self, x: torch.Tensor, ctx: MixerContext) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Local head counts come from the weights, so a tensor-parallel shard needs no rank logic.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.rope is not None:
            cos, sin = ctx.rope
            if torch.is_grad_enabled():
                q, k = (apply_rotary(t, cos, sin, self.rotary_interleaved) for t in (q, k))
            else:  # inference: queries and keys rotated in one call (decode steps are bound by per-op overhead)
                heads = q.shape[2]
                qk = apply_rotary(torch.cat([q, k], dim=2), cos, sin, self.rotary_interleaved)
                q, k = qk[:, :, :heads], qk[:, :, heads:]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        k, v = ctx.update_kv(self.layer_id, k, v)
        out = attend(q, k, v, ctx, scale=self.scale, window_size=self.window_size, sink_logits=self.sink_logits(q),
                     dropout=self.dropout if self.training else 0.0, backend=self.attention_backend)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
