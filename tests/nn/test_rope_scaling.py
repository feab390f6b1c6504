"""RoPE variants against closed forms: YaRN and Llama-3 frequencies written per pair in plain
Python (and held against transformers' implementations when installed), partial and interleaved
rotation as complex multiplication, and YaRN's cos/sin factor."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.nn.rope_scaling import build_rotary, rotary_inv_freq, yarn_attention_factor
from meshtron.nn.rotary import RotaryEmbedding, apply_rotary
from tests.models.hf.pin import import_transformers

YARN = dict(position_embedding_type="yarn", kv_channels=32, num_attention_heads=2, hidden_size=64,
            rotary_base=10000.0, yarn_rotary_scaling_factor=8.0, yarn_original_max_position_embeddings=256,
            yarn_beta_fast=32.0, yarn_beta_slow=1.0)


def yarn_by_hand(d, theta, s, original, beta_fast, beta_slow, round_to_int):
    """Pair i rotates r_i = original * theta^(-2i/d) / (2 pi) times over the original context."""
    def dim_of(rotations):
        return d * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(theta))
    lo, hi = dim_of(beta_fast), dim_of(beta_slow)
    if round_to_int:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    out = []
    for i in range(d // 2):
        f = theta ** (-2 * i / d)
        g = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(f / s * g + f * (1 - g))
    return out


@pytest.mark.parametrize("round_to_int", [True, False])
def test_yarn_frequencies_closed_form(round_to_int):
    cfg = ModelConfig(**YARN, correction_range_round_to_int=round_to_int)
    got = rotary_inv_freq(cfg)
    expected = yarn_by_hand(32, 10000.0, 8.0, 256, 32.0, 1.0, round_to_int)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), atol=0, rtol=1e-12)
    if not round_to_int:
        # fast pairs (>= beta_fast rotations) keep their frequency, slow ones (<= beta_slow) are divided by s
        for i, f in enumerate(got.tolist()):
            base = 10000.0 ** (-2 * i / 32)
            rotations = 256 * base / (2 * math.pi)
            if rotations >= 32.0:
                assert f == pytest.approx(base, rel=1e-12)
            elif rotations <= 1.0:
                assert f == pytest.approx(base / 8.0, rel=1e-12)


def test_yarn_cos_sin_factor():
    for m, m_all, expected in [(1.0, 0.0, 0.1 * math.log(8.0) + 1.0), (1.0, 1.0, 1.0),
                               (0.707, 1.0, (0.0707 * math.log(8.0) + 1) / (0.1 * math.log(8.0) + 1))]:
        cfg = ModelConfig(**YARN, yarn_mscale=m, yarn_mscale_all_dim=m_all)
        assert yarn_attention_factor(cfg) == pytest.approx(expected, rel=1e-12)
        cos, sin = build_rotary(cfg)(torch.arange(5)[None])
        torch.testing.assert_close(cos.square() + sin.square(), torch.full_like(cos, expected ** 2), atol=1e-5, rtol=0)


def llama3_by_hand(d, theta, factor, low, high, original):
    out = []
    for i in range(d // 2):
        f = theta ** (-2 * i / d)
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            out.append(f)
        elif wavelength > original / low:
            out.append(f / factor)
        else:
            a = (original / wavelength - low) / (high - low)
            out.append((1 - a) * f / factor + a * f)
    return out


def test_llama3_frequencies_closed_form():
    cfg = ModelConfig(hidden_size=128, num_attention_heads=2, rotary_base=500000.0, rope_scaling=True,
                      rope_scaling_factor=8.0, rope_scaling_original_max_position_embeddings=64)
    expected = llama3_by_hand(64, 500000.0, 8.0, 1.0, 4.0, 64)
    torch.testing.assert_close(rotary_inv_freq(cfg), torch.tensor(expected, dtype=torch.float64), atol=0, rtol=1e-12)
    kinds = {("kept" if e == 500000.0 ** (-2 * i / 64) else "scaled" if e == 500000.0 ** (-2 * i / 64) / 8 else "mixed")
             for i, e in enumerate(expected)}
    assert kinds == {"kept", "scaled", "mixed"}  # the test covers all three regimes


def test_frequencies_match_transformers():
    import_transformers()
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=2048,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                      "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = ModelConfig(**YARN)
    torch.testing.assert_close(rotary_inv_freq(cfg).float(), inv_freq, atol=0, rtol=1e-6)
    assert yarn_attention_factor(cfg) == pytest.approx(factor, rel=1e-7)
    hf = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=2048,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cfg = ModelConfig(hidden_size=128, num_attention_heads=2, rotary_base=500000.0, rope_scaling=True,
                      rope_scaling_original_max_position_embeddings=64)
    torch.testing.assert_close(rotary_inv_freq(cfg).float(), inv_freq, atol=0, rtol=1e-6)


def complex_rotation(x, positions, inv_freq, pairs):
    """Rotate the (real, imag) pairs `pairs` of x (..., d) by position * inv_freq, in complex numbers."""
    out = x.double().clone()
    for i, (a, b) in enumerate(pairs):
        z = torch.complex(x[..., a].double(), x[..., b].double())
        z = z * torch.polar(torch.ones_like(z.real), positions.double()[:, :, None] * inv_freq[i])
        out[..., a], out[..., b] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_rotates_only_the_first_dims(interleaved):
    head_dim, rot = 12, 8  # rotary_percent 2/3
    x = torch.randn(2, 5, 3, head_dim)
    positions = torch.arange(5).expand(2, 5)
    rope = RotaryEmbedding(rot, 500.0)
    out = apply_rotary(x, *rope(positions), interleaved=interleaved)
    pairs = [(2 * i, 2 * i + 1) for i in range(rot // 2)] if interleaved else [(i, i + rot // 2) for i in range(rot // 2)]
    ref = complex_rotation(x, positions, rope.inv_freq.double(), pairs)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert torch.equal(out[..., rot:], x[..., rot:])


def test_rotary_percent_sets_the_rotated_width():
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, rotary_percent=0.5)
    assert cfg.rotary_dim == 8 and build_rotary(cfg).inv_freq.shape == (4,)
