"""Layers against naive references: RMSNorm formula, RoPE as complex rotation, attention as an
explicit softmax loop with GQA, masked cross-entropy as a per-token loop."""

from __future__ import annotations

import math

import torch

from meshtron.nn.attention import Attention
from meshtron.nn.context import PackedContext
from meshtron.nn.loss import masked_cross_entropy
from meshtron.nn.norm import RMSNorm
from meshtron.nn.rotary import RotaryEmbedding, apply_rotary


def test_rmsnorm_formula():
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    norm = RMSNorm(8, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * torch.linspace(0.5, 1.5, 8, dtype=torch.float64)
    torch.testing.assert_close(norm(x), ref)


def test_rmsnorm_inference_path_equals_the_training_path():
    """fp32 without autograd takes torch's fused rms_norm: the same bits as the written-out formula (with grad)."""
    torch.manual_seed(0)
    for dim in (8, 100, 768, 4096):
        norm = RMSNorm(dim, eps=1e-5)
        with torch.no_grad():
            norm.weight.normal_()
        x = torch.randn(3, 7, dim) * 5
        trained = norm(x.requires_grad_())  # grad enabled: the formula
        with torch.inference_mode():
            assert torch.equal(norm(x.detach()), trained.detach())


def test_rope_fp32_path_equals_the_general_path():
    """fp32 full-width rotate-half rotation skips the casts and slices: the same bits as in float64 cast back."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 64)
    cos, sin = RotaryEmbedding(64)(torch.arange(5)[None].expand(2, 5))
    ref = (x.double() * cos.double()[:, :, None] + torch.cat([-x[..., 32:], x[..., :32]], -1).double()
           * sin.double()[:, :, None])
    torch.testing.assert_close(apply_rotary(x, cos, sin), ref.float(), atol=1e-6, rtol=0)
    partial = apply_rotary(x, cos[..., :32], sin[..., :32])  # partial rotary keeps the general path
    torch.testing.assert_close(partial[..., 32:], x[..., 32:], atol=0, rtol=0)


def test_rope_equals_complex_rotation():
    head_dim, base = 8, 10000.0
    x = torch.randn(1, 6, 2, head_dim)
    cos, sin = RotaryEmbedding(head_dim, base)(torch.arange(6)[None])
    out = apply_rotary(x, cos, sin)
    half = head_dim // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    freqs = base ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    rot = torch.polar(torch.ones(6, half, dtype=torch.float64), torch.arange(6)[:, None].double() * freqs)
    zr = z * rot[None, :, None, :]
    ref = torch.cat([zr.real, zr.imag], -1).float()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_attention_equals_naive_loop():
    torch.manual_seed(0)
    attn = Attention(16, num_heads=4, num_kv_heads=2, head_dim=4, layer_id=0, qkv_bias=True, out_bias=True)
    x = torch.randn(2, 5, 16)
    ctx = PackedContext.for_tokens(torch.zeros(2, 5, dtype=torch.long))
    out = attn(x, ctx)
    q = attn.wq(x).view(2, 5, 4, 4)
    k = attn.wk(x).view(2, 5, 2, 4)
    v = attn.wv(x).view(2, 5, 2, 4)
    ref = torch.zeros(2, 5, 4, 4)
    for b in range(2):
        for h in range(4):
            g = h // 2  # query heads 0,1 share kv group 0
            for i in range(5):
                scores = torch.stack([q[b, i, h] @ k[b, j, g] / math.sqrt(4) for j in range(i + 1)])
                p = scores.softmax(0)
                ref[b, i, h] = sum(p[j] * v[b, j, g] for j in range(i + 1))
    torch.testing.assert_close(out, attn.wo(ref.reshape(2, 5, 16)), atol=1e-5, rtol=0)


def test_masked_cross_entropy_is_a_token_sum():
    logits = torch.randn(2, 3, 7)
    labels = torch.randint(0, 7, (2, 3))
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    total, count = masked_cross_entropy(logits, labels, mask)
    ref = sum(-torch.log_softmax(logits[b, s], -1)[labels[b, s]] for b in range(2) for s in range(3) if mask[b, s])
    torch.testing.assert_close(total, ref)
    assert count.item() == 4
