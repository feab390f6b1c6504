"""RoPE variants against closed forms: YaRN and Llama-3 frequencies written per pair in plain
Python, partial and interleaved rotation as complex multiplication, and YaRN's cos/sin factor; and
against transformers' rotary init functions and Megatron-LM's RotaryEmbedding bit for bit (default,
linear, Llama-3, YaRN), cos/sin included, at positions near the end of a 128k context."""

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
    assert got.dtype == torch.float32
    expected = yarn_by_hand(32, 10000.0, 8.0, 256, 32.0, 1.0, round_to_int)
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), atol=0, rtol=1e-6)
    if not round_to_int:
        # fast pairs (>= beta_fast rotations) keep their frequency, slow ones (<= beta_slow) are divided by s
        for i, f in enumerate(got.tolist()):
            base = 10000.0 ** (-2 * i / 32)
            rotations = 256 * base / (2 * math.pi)
            if rotations >= 32.0:
                assert f == pytest.approx(base, rel=1e-6)
            elif rotations <= 1.0:
                assert f == pytest.approx(base / 8.0, rel=1e-6)


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
    torch.testing.assert_close(rotary_inv_freq(cfg).double(), torch.tensor(expected, dtype=torch.float64), atol=0,
                               rtol=1e-6)
    kinds = {("kept" if e == 500000.0 ** (-2 * i / 64) else "scaled" if e == 500000.0 ** (-2 * i / 64) / 8 else "mixed")
             for i, e in enumerate(expected)}
    assert kinds == {"kept", "scaled", "mixed"}  # the test covers all three regimes


def test_linear_frequencies_closed_form():
    cfg = ModelConfig(hidden_size=64, num_attention_heads=2, rope_scaling=True, rope_scaling_type="linear",
                      rope_scaling_factor=4.0)
    cfg.validate()
    expected = [10000.0 ** (-2 * i / 32) / 4.0 for i in range(16)]
    torch.testing.assert_close(rotary_inv_freq(cfg).double(), torch.tensor(expected, dtype=torch.float64), atol=0,
                               rtol=1e-6)


# A 128k-context model (head_dim 128) under each RoPE rule: meshtron's fields and transformers' rope_parameters
LONG = dict(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072)
FAR_CASES = {
    "default": (dict(rotary_base=10000.0), {"rope_type": "default", "rope_theta": 10000.0}),
    "linear": (dict(rotary_base=10000.0, rope_scaling=True, rope_scaling_type="linear", rope_scaling_factor=4.0),
               {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3": (dict(rotary_base=500000.0, rope_scaling=True, rope_scaling_factor=8.0,
                    rope_scaling_original_max_position_embeddings=8192),
               {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn": (dict(position_embedding_type="yarn", rotary_base=1000000.0, yarn_rotary_scaling_factor=4.0,
                  yarn_original_max_position_embeddings=32768),
             {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}),
    "yarn_untruncated": (dict(position_embedding_type="yarn", rotary_base=150000.0, yarn_rotary_scaling_factor=32.0,
                              yarn_original_max_position_embeddings=4096, correction_range_round_to_int=False),
                         {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                          "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}),
}


@pytest.mark.parametrize("case", sorted(FAR_CASES))
def test_frequencies_and_far_cos_sin_match_transformers_bit_for_bit(case):
    """inv_freq equal to transformers' init function's, and cos/sin equal to its rotary module's at
    positions 0, 8191 and 131071: an ulp of a frequency is 1e-3 rad of angle at 131071."""
    import_transformers()
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    fields, params = FAR_CASES[case]
    cfg = ModelConfig(**LONG, **fields)
    cfg.validate()
    hf = LlamaConfig(**LONG, head_dim=128, rope_parameters=dict(params))
    init = ROPE_INIT_FUNCTIONS.get(params["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters)
    inv_freq, factor = init(hf, device="cpu")
    ours = build_rotary(cfg)
    assert ours.inv_freq.dtype == torch.float32 and torch.equal(ours.inv_freq, inv_freq)
    assert ours.attention_factor == factor
    positions = torch.tensor([[0, 1, 8191, 131071]])
    cos, sin = ours(positions)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


@pytest.mark.parametrize("case", ["default", "llama3"])
def test_frequencies_match_megatron_core(case):
    """Megatron-LM computes the same float32 frequencies (its RotaryEmbedding, CPU-initialised)."""
    rotary = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    fields, params = FAR_CASES[case]
    cfg = ModelConfig(**LONG, **fields)
    theirs = rotary.RotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=params["rope_theta"],
                                    use_cpu_initialization=True, rope_scaling=cfg.rope_scaling,
                                    rope_scaling_factor=cfg.rope_scaling_factor)
    assert torch.equal(build_rotary(cfg).inv_freq, theirs.inv_freq)


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
