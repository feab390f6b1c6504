"""Multi-latent attention (MLA, DeepSeek-V2/V3): low-rank queries and key/values, decoupled RoPE.

Per token x (H heads, d_n = qk_head_dim, d_r = qk_pos_emb_head_dim, d_v = v_head_dim):
    q      = W_qb norm(W_qa x)            (or W_q x without a query latent)   -> H x (d_n + d_r)
    [c, k_r] = W_kva x                    c: the kv latent (kv_lora_rank), k_r: d_r dims shared by all heads
    [k_n, v] = W_kvb norm(c)              -> H x (d_n + d_v)
    q = [q_n, rope(q_r)],  k = [k_n, rope(k_r)] (k_r broadcast over heads)
    out = softmax(scale * q k^T + mask) v,   y = W_o out,   scale = 1/sqrt(d_n + d_r) by default.
Only d_r dimensions carry position, so the latent c never needs rotating. The cache here holds
the expanded keys/values (the simple and paged contexts store per-head tensors).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from meshtron.nn.attention import SOFTMAX_TYPES
from meshtron.nn.attention_core import attend
from meshtron.nn.context import MixerContext
from meshtron.nn.norm import build_norm
from meshtron.nn.rotary import apply_rotary


class MultiLatentAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, *, layer_id: int, q_lora_rank: Optional[int],
                 kv_lora_rank: int, qk_head_dim: int, qk_pos_emb_head_dim: int, v_head_dim: int,
                 qkv_bias: bool = False, out_bias: bool = False, norm: str = "RMSNorm", norm_eps: float = 1e-5,
                 dropout: float = 0.0, softmax_type: str = "vanilla", softmax_scale: Optional[float] = None,
                 window_size: Optional[int] = None, rotary_interleaved: bool = False,
                 attention_backend: str = "auto"):
        super().__init__()
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type {softmax_type!r}; choose one of {SOFTMAX_TYPES}")
        self.layer_id = layer_id
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim = qk_head_dim, qk_pos_emb_head_dim, v_head_dim
        q_dim = qk_head_dim + qk_pos_emb_head_dim
        self.scale = softmax_scale if softmax_scale is not None else q_dim ** -0.5
        self.dropout, self.window_size, self.softmax_type = dropout, window_size, softmax_type
        self.rotary_interleaved = rotary_interleaved
        self.attention_backend = attention_backend
        if q_lora_rank is None:
            self.wq: Optional[nn.Linear] = nn.Linear(hidden_size, num_heads * q_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(hidden_size, q_lora_rank, bias=qkv_bias)
            self.q_norm = build_norm(norm, q_lora_rank, norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, num_heads * q_dim, bias=False)
        self.wkv_a = nn.Linear(hidden_size, kv_lora_rank + qk_pos_emb_head_dim, bias=qkv_bias)
        self.kv_norm = build_norm(norm, kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, num_heads * (qk_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(num_heads * v_head_dim, hidden_size, bias=out_bias)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if softmax_type == "learnable" else None

    def sink_logits(self, q: torch.Tensor) -> Optional[torch.Tensor]:
        if self.softmax_type == "vanilla":
            return None
        if self.sinks is None:
            return q.new_zeros(q.shape[1], dtype=torch.float32)
        # Under tensor parallelism the sinks are split by head like the queries: use this rank's share.
        return self.sinks.to_local() if hasattr(self.sinks, "to_local") else self.sinks

    def forward(self, x: torch.Tensor, ctx: MixerContext) -> torch.Tensor:
        batch, seq, _ = x.shape
        d_n, d_r, d_v = self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(batch, seq, -1, d_n + d_r)  # (batch, seq, heads, d_n + d_r)
        q_n, q_r = q.split([d_n, d_r], dim=-1)
        latent, k_r = self.wkv_a(x).split([self.kv_lora_rank, d_r], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, d_n + d_v)
        k_n, v = kv.split([d_n, d_v], dim=-1)
        k_r = k_r.view(batch, seq, 1, d_r)
        if ctx.rope is not None:
            cos, sin = ctx.rope
            q_r, k_r = apply_rotary(q_r, cos, sin, self.rotary_interleaved), apply_rotary(k_r, cos, sin, self.rotary_interleaved)
        q = torch.cat([q_n, q_r], dim=-1)
        k = torch.cat([k_n, k_r.expand(-1, -1, k_n.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, dim)
        k, v = ctx.update_kv(self.layer_id, k, v)
        out = attend(q, k, v, ctx, scale=self.scale, window_size=self.window_size, sink_logits=self.sink_logits(q),
                     dropout=self.dropout if self.training else 0.0, backend=self.attention_backend)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
