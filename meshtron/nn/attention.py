"""Causal self-attention with grouped-query heads, RoPE and optional biases.

q = x Wq, k = x Wk, v = x Wv (num_kv_heads <= num_heads), rotated by position, then
softmax(q k^T / sqrt(head_dim) + mask) v through `scaled_dot_product_attention`, then Wo.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.nn.rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 layer_id: int, qkv_bias: bool = False, out_bias: bool = False, dropout: float = 0.0):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dropout = dropout
        self.wq = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(num_heads * head_dim, hidden_size, bias=out_bias)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Local head counts come from the weights, so a tensor-parallel shard needs no rank logic.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # (batch, seq, heads, head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if ctx.rope is not None:
            cos, sin = ctx.rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        k, v = ctx.update_kv(self.layer_id, k, v)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1], **ctx.sdpa_mask(),
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
