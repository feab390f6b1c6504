"""RoPE frequency scaling for long contexts: linear, Llama-3 and YaRN, and the RoPE module a config asks for.

With inv_freq_i = theta^(-2i/d) and wavelength lambda_i = 2 pi / inv_freq_i:

Linear (position interpolation, factor s; model.rope_scaling_type linear): inv_freq_i / s, i.e. position
p rotates as p / s did.

Llama-3 (factor s, low/high frequency factors l/h, original context L):
    lambda_i < L/h        -> inv_freq_i                 (high frequencies are kept)
    lambda_i > L/l        -> inv_freq_i / s             (low frequencies are interpolated)
    otherwise             -> (1 - a) inv_freq_i / s + a inv_freq_i,  a = (L / lambda_i - l) / (h - l)

YaRN (factor s, original context L, beta_fast, beta_slow): dimension pair i rotates
r_i = L / lambda_i times over the original context. The correction range [lo, hi] holds the pairs
with beta_slow <= r <= beta_fast, found by inverting r: dim(r) = d ln(L / (2 pi r)) / (2 ln theta),
lo = dim(beta_fast), hi = dim(beta_slow) (floor/ceil when rounding to int, clipped to [0, d-1]).
With the ramp g_i = clip((i - lo) / (hi - lo), 0, 1):
    inv_freq_i = inv_freq_i / s * g_i + inv_freq_i * (1 - g_i)
so fast pairs (i < lo) keep their frequency and slow ones (i > hi) are interpolated. cos and sin are
multiplied by mscale(s, m) / mscale(s, m_all) with mscale(s, m) = 0.1 m ln s + 1 (1 when s <= 1);
multi-latent attention also multiplies its softmax scale by mscale(s, m_all)^2.

Every rule runs in float32 with the operations in the order transformers' rotary init functions and
Megatron-LM use (they agree bit for bit), so a converted model rotates exactly as its source does, also
at positions near the end of a long context where one ulp of a frequency becomes a visible angle.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from meshtron.config.schema import ModelConfig
from meshtron.nn.rotary import RotaryEmbedding, default_inv_freq


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq
    low_wavelength = original_max_position_embeddings / low_freq_factor
    high_wavelength = original_max_position_embeddings / high_freq_factor
    scaled = torch.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return torch.where(medium, smoothed, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(rotary_dim: int, base: float, original_max_position_embeddings: int, beta_fast: float,
                          beta_slow: float, round_to_int: bool) -> tuple[float, float]:
    def dim_for(rotations: float) -> float:
        return rotary_dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


def yarn_inv_freq(rotary_dim: int, base: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float, beta_slow: float, round_to_int: bool) -> torch.Tensor:
    powers = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)  # theta^(2i/d)
    extrapolated = 1.0 / powers
    interpolated = 1.0 / (factor * powers)
    low, high = yarn_correction_range(rotary_dim, base, original_max_position_embeddings, beta_fast, beta_slow,
                                      round_to_int)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of the extrapolated frequency (1 - (1 - g) is not always g in float32)
    return interpolated * (1 - kept) + extrapolated * kept


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """The constant YaRN puts on cos/sin."""
    s = cfg.yarn_rotary_scaling_factor
    return yarn_get_mscale(s, cfg.yarn_mscale) / yarn_get_mscale(s, cfg.yarn_mscale_all_dim)


def rotary_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The (possibly scaled) inverse frequencies of `cfg`, float32, one per rotated pair."""
    dim = cfg.rotary_dim
    if cfg.position_embedding_type == "yarn":
        return yarn_inv_freq(dim, cfg.rotary_base, cfg.yarn_rotary_scaling_factor,
                             cfg.yarn_original_max_position_embeddings, cfg.yarn_beta_fast, cfg.yarn_beta_slow,
                             cfg.correction_range_round_to_int)
    inv_freq = default_inv_freq(dim, cfg.rotary_base)
    if not cfg.rope_scaling:
        return inv_freq
    if cfg.rope_scaling_type == "linear":
        return inv_freq / cfg.rope_scaling_factor
    return llama3_inv_freq(inv_freq, cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor,
                           cfg.rope_scaling_high_freq_factor, cfg.rope_scaling_original_max_position_embeddings)


def build_rotary(cfg: ModelConfig) -> Optional[RotaryEmbedding]:
    if not cfg.uses_rope:
        return None
    factor = yarn_attention_factor(cfg) if cfg.position_embedding_type == "yarn" else 1.0
    return RotaryEmbedding(cfg.rotary_dim, cfg.rotary_base, inv_freq=rotary_inv_freq(cfg), attention_factor=factor)


def attention_softmax_scale(cfg: ModelConfig, qk_dim: int) -> float:
    """Logit scale: model.softmax_scale or 1/sqrt(qk_dim); MLA under YaRN adds mscale(s, m_all)^2."""
    scale = cfg.softmax_scale if cfg.softmax_scale is not None else qk_dim ** -0.5
    if cfg.multi_latent_attention and cfg.position_embedding_type == "yarn":
        scale *= yarn_get_mscale(cfg.yarn_rotary_scaling_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale
