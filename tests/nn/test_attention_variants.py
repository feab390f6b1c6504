"""Attention options against a naive per-query loop in float64: sliding windows (with packed
documents and KV-cache decoding), off-by-one and learnable sinks, QK-norm, softmax scale, and the
sink softmax at logits of +-1e4."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.nn.attention import Attention
from meshtron.nn.attention_core import sink_attention
from meshtron.nn.context import KVCacheContext, PackedContext


def naive_attention(q, k, v, *, scale, window=None, doc=None, sink=None):
    """q (b, s, h, d), k/v (b, s, g, d) -> (b, s, h, dv) with explicit loops, float64.

    Query i sees key j iff j <= i, same document, and i - j < window; the sink adds exp(sink[h]) to
    the denominator only."""
    b, s, h, _ = q.shape
    g = k.shape[2]
    q, k, v = q.detach().double(), k.detach().double(), v.detach().double()
    out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            gi = hi // (h // g)
            for i in range(s):
                keys = [j for j in range(i + 1) if (window is None or i - j < window)
                        and (doc is None or doc[bi, j] == doc[bi, i])]
                logits = torch.stack([q[bi, i, hi] @ k[bi, j, gi] * scale for j in keys])
                top = logits.max()
                if sink is not None:
                    top = torch.maximum(top, torch.tensor(float(sink[hi]), dtype=torch.float64))
                weights = torch.exp(logits - top)
                denom = weights.sum() + (math.exp(float(sink[hi]) - float(top)) if sink is not None else 0.0)
                out[bi, i, hi] = sum(w / denom * v[bi, j, gi] for w, j in zip(weights, keys))
    return out


def projections(attn: Attention, x: torch.Tensor):
    b, s, _ = x.shape
    q = attn.wq(x).view(b, s, -1, attn.head_dim)
    k = attn.wk(x).view(b, s, -1, attn.head_dim)
    v = attn.wv(x).view(b, s, -1, attn.head_dim)
    return q, k, v


CASES = [
    dict(window_size=3),
    dict(window_size=2, softmax_type="off-by-one"),
    dict(softmax_type="learnable"),
    dict(window_size=4, softmax_type="learnable", softmax_scale=0.7),
]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("packed", [False, True])
def test_attention_options_equal_naive_loop(kw, packed):
    torch.manual_seed(0)
    attn = Attention(16, num_heads=4, num_kv_heads=2, head_dim=4, layer_id=0, **kw).double()
    if attn.sinks is not None:
        with torch.no_grad():
            attn.sinks.copy_(torch.tensor([-1.0, 0.5, 2.0, 0.0]))
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 2, 2, 2]]) if packed else None
    ctx = PackedContext.for_tokens(torch.zeros(2, 9, dtype=torch.long), document_ids=doc)
    out = attn(x, ctx)
    q, k, v = projections(attn, x)
    sink = None
    if kw.get("softmax_type") == "off-by-one":
        sink = [0.0] * 4
    elif kw.get("softmax_type") == "learnable":
        sink = attn.sinks.tolist()
    ref = naive_attention(q, k, v, scale=kw.get("softmax_scale", 0.5), window=kw.get("window_size"), doc=doc, sink=sink)
    torch.testing.assert_close(out, attn.wo(ref.reshape(2, 9, 16)), atol=1e-10, rtol=0)


@pytest.mark.parametrize("kw", CASES)
def test_kv_cache_decoding_with_windows_and_sinks(kw):
    torch.manual_seed(1)
    attn = Attention(16, num_heads=4, num_kv_heads=2, head_dim=4, layer_id=0, **kw).eval()
    x = torch.randn(1, 10, 16)
    full = attn(x, PackedContext.for_tokens(torch.zeros(1, 10, dtype=torch.long)))
    ctx = KVCacheContext(batch_size=1, max_len=10)
    pieces = []
    for a, b in [(0, 4), (4, 5), (5, 6), (6, 9), (9, 10)]:
        ctx.begin(x[:, a:b, 0].long())
        pieces.append(attn(x[:, a:b], ctx))
        ctx.advance()
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-6, rtol=0)


def test_qk_norm_normalises_each_head_before_attention():
    torch.manual_seed(0)
    attn = Attention(16, num_heads=4, num_kv_heads=4, head_dim=4, layer_id=0, qk_norm="RMSNorm", norm_eps=1e-6).double()
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
        attn.k_norm.weight.copy_(torch.linspace(2.0, 1.0, 4, dtype=torch.float64))
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    out = attn(x, PackedContext.for_tokens(torch.zeros(1, 6, dtype=torch.long)))
    q, k, v = projections(attn, x)
    rms = lambda t, w: t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
    q = rms(q, torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
    k = rms(k, torch.linspace(2.0, 1.0, 4, dtype=torch.float64))
    ref = naive_attention(q, k, v, scale=0.5)
    torch.testing.assert_close(out, attn.wo(ref.reshape(1, 6, 16)), atol=1e-10, rtol=0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sink_softmax_is_stable_at_logits_of_1e4(sign):
    """Logits and sinks of +-1e4: finite outputs and gradients in fp32; in float64 the same code
    equals the naive loop (so the only error left in fp32 is the rounding of the 1e4 logits)."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    q = q / q.norm(dim=-1, keepdim=True) * 100.0
    k = (q * sign).clone()  # q_i . k_i = sign * 1e4: the diagonal dominates (or is suppressed)
    v = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    for sink_value in (0.0, 1e4, -1e4):
        ref = naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=1.0, sink=[sink_value] * 2)
        exact = sink_attention(q, k, v, mask, torch.full((2,), sink_value, dtype=torch.float64), scale=1.0)
        torch.testing.assert_close(exact.transpose(1, 2), ref, atol=1e-9, rtol=0)
        sinks = torch.full((2,), sink_value, requires_grad=True)
        qg, kg, vg = (t.float().requires_grad_(True) for t in (q, k, v))
        out = sink_attention(qg, kg, vg, mask, sinks, scale=1.0)
        out.sum().backward()
        assert torch.isfinite(out).all()
        for t in (qg, kg, vg, sinks):
            assert torch.isfinite(t.grad).all()
        # fp32 rounds a 1e4 logit by up to ~1e-3, which moves probabilities by as much
        torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=5e-3, rtol=0)


def test_fully_masked_row_with_a_sink_is_zero_not_nan():
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    mask = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    out = sink_attention(q, k, v, mask, torch.zeros(1), scale=1.0)
    assert torch.equal(out, torch.zeros_like(out))
