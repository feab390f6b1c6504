"""Rotary position embedding (RoPE), rotate-half layout: the head dim is split into two halves
that form the real and imaginary parts; position p rotates pair i by p * theta^(-2i/d)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (batch, seq) -> cos, sin each (batch, seq, head_dim), fp32."""
        angles = positions.float()[..., None] * self.inv_freq  # (batch, seq, head_dim/2)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, heads, head_dim); cos/sin (batch, seq, head_dim)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)
