"""The attention product shared by every attention mixer: softmax(scale * q k^T + mask) v, with sinks.

Sink attention adds one virtual key per head whose logit is a constant s_h and whose value is 0:
    p_ij = exp(a_ij) / (exp(s_h) + sum_j' exp(a_ij')),   out_i = sum_j p_ij v_j
so a head may put probability on "nothing" instead of being forced onto some key. `off-by-one` fixes
s_h = 0 (softmax_1); `learnable` learns s_h per head (GPT-OSS). `scaled_dot_product_attention`
cannot express the extra column, so the sink path writes the softmax out: fp32 logits, masked keys
at -inf, the sink logit appended as a last column, softmax (which subtracts the row maximum, so
logits of +-1e4 stay finite), and the column dropped again. The sink keeps every row's denominator
positive, so even a fully masked row is finite (all zeros).

Kernels (`backend`, model.attention_backend): a full-sequence context (training) may run the product
through FlexAttention (nn/flex_attention.py: one block mask per forward, sinks via the log-sum-exp, no
(seq, seq) tensor); `auto` does so on CUDA when documents, a window or sinks would otherwise keep
SDPA off its flash kernel or send sinks down the eager path. On a CPU `auto` keeps the paths above.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from meshtron.nn.context import MixerContext
from meshtron.nn.flex_attention import flex_attend, use_flex


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: MixerContext, *, scale: float,
           window_size: Optional[int] = None, sink_logits: Optional[torch.Tensor] = None,
           dropout: float = 0.0, backend: str = "auto") -> torch.Tensor:
    """q (batch, heads, q_len, d), k (batch, kv_heads, k_len, d), v (batch, kv_heads, k_len, dv)
    -> (batch, heads, q_len, dv). Masks come from `ctx` (causal, documents, window); `backend` is
    auto, sdpa or flex (flex applies to contexts with a `flex_block_mask`; others keep SDPA)."""
    # A context whose keys/values live on several ranks (context parallelism: parallel/context_parallel.py)
    # computes this same product itself (ring attention), so nn/ stays single-device code.
    ctx_attend = getattr(ctx, "attend", None)
    if ctx_attend is not None:
        return ctx_attend(q, k, v, scale=scale, window_size=window_size, sink_logits=sink_logits, dropout=dropout)
    if hasattr(ctx, "flex_block_mask") and use_flex(backend, q, masked=not ctx.is_plain_causal(window_size),
                                                     sinks=sink_logits is not None, dropout=dropout):
        return flex_attend(q, k, v, ctx.flex_block_mask(window_size), scale=scale, sink_logits=sink_logits)
    if sink_logits is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1], **ctx.sdpa_mask(window_size))
    return sink_attention(q, k, v, ctx.attention_mask(window_size), sink_logits, scale=scale, dropout=dropout)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sink_logits: torch.Tensor, *, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """mask: boolean, broadcastable to (batch, heads, q_len, k_len), True = may attend;
    sink_logits: (heads,) the virtual sink logit of each head."""
    batch, heads, q_len, _ = q.shape
    if k.shape[1] != heads:  # grouped-query attention: each key/value head serves heads/kv_heads queries
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    compute = torch.promote_types(q.dtype, torch.float32)  # at least fp32 for the softmax
    logits = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale  # (batch, heads, q_len, k_len)
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sink_logits.to(compute).view(1, heads, 1, 1).expand(batch, heads, q_len, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    if dropout > 0:
        probs = F.dropout(probs, dropout)
    return torch.matmul(probs.to(v.dtype), v)
