"""Rotary position embedding (RoPE).

Position p rotates the i-th pair of a head's first `rotary_dim` dimensions by the angle
p * inv_freq[i] (inv_freq[i] = theta^(-2i/rotary_dim) unless a scaling rule changed it):
    (x_a, x_b) -> (x_a cos - x_b sin, x_b cos + x_a sin).
Two layouts pair the dimensions differently: rotate-half pairs i with i + rotary_dim/2 (Llama,
GPT-NeoX); interleaved pairs 2i with 2i+1 (the original RoFormer/DeepSeek layout). Dimensions past
`rotary_dim` (partial rotary) pass through unchanged. cos/sin may carry a constant factor (YaRN's
attention scaling), which multiplies the rotated part.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, in float32 and in the order of operations transformers and Megatron-LM
    use: a float64 value rounded once differs from theirs by an ulp in about a third of the entries, and
    that ulp grows with the position into a visible cos/sin difference near the end of a long context."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base ** exponents)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0, *, inv_freq: Optional[torch.Tensor] = None,
                 attention_factor: float = 1.0):
        """`head_dim` is the number of rotated dimensions; `inv_freq` (float32) overrides the default frequencies."""
        super().__init__()
        self.rotary_dim = head_dim
        if inv_freq is None:
            inv_freq = default_inv_freq(head_dim, base)
        assert inv_freq.shape == (head_dim // 2,)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_factor = attention_factor

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (batch, seq) -> cos, sin each (batch, seq, rotary_dim), fp32, both halves repeated."""
        angles = positions.float()[..., None] * self.inv_freq  # (batch, seq, rotary_dim/2)
        angles = torch.cat([angles, angles], dim=-1)
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x (batch, seq, heads, head_dim); cos/sin (batch, seq, rotary_dim) with rotary_dim <= head_dim."""
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (batch, seq, 1, rotary_dim)
    if x.dtype == torch.float32 and rot == x.shape[-1] and not interleaved:
        return x * cos + rotate_half(x) * sin  # the common case below without its casts and slices (decode)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x_rot, x_pass = xf[..., :rot], xf[..., rot:]
    if interleaved:
        # The halves of cos/sin are equal; pair (2i, 2i+1) uses angle i, and the layout stays interleaved.
        c, s = cos[..., : rot // 2], sin[..., : rot // 2]
        even, odd = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)
    else:
        rotated = x_rot * cos + rotate_half(x_rot) * sin
    if x_pass.shape[-1] == 0:
        return rotated.to(x.dtype)
    return torch.cat([rotated, x_pass], dim=-1).to(x.dtype)
