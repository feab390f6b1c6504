"""Position-wise MLP: down(act(x W_up)) or, for gated activations, down(act(x W_gate) * x W_up)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


# name -> (activation, gated)
ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "swiglu": (F.silu, True),
    "quick_geglu": (quick_gelu, True),
    "gelu": (F.gelu, False),
    "squared_relu": (squared_relu, False),
}


class MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, activation: str, *, bias: bool = False):
        super().__init__()
        self.act, gated = ACTIVATIONS[activation]
        self.w_gate = nn.Linear(hidden_size, ffn_size, bias=bias) if gated else None
        self.w_up = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.w_down = nn.Linear(ffn_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        if self.w_gate is not None:
            return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))
        return self.w_down(self.act(self.w_up(x)))
