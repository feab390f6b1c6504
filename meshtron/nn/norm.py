"""Normalisation layers: RMSNorm and LayerNorm, computed in (at least) fp32 and cast back."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not torch.is_grad_enabled():
            # inference in fp32: torch's fused kernel, bitwise the same as the lines below (one op for
            # eight; a decode step runs 2 * layers + 1 norms on one token each)
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        compute = torch.promote_types(x.dtype, torch.float32)
        h = x.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.to(compute)).to(x.dtype)


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        h = nn.functional.layer_norm(x.to(compute), (x.shape[-1],), self.weight.to(compute), self.bias.to(compute),
                                     self.eps)
        return h.to(x.dtype)


NORMS: dict[str, type[nn.Module]] = {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    return NORMS[kind](dim, eps)
