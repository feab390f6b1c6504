"""Position-wise MLP: down(act(x W_up)), or for gated activations (*GLU) down(act(x W_gate) * x W_up).

Activations: SiLU (SwiGLU), GELU exact erf form or its tanh approximation (GeGLU, GELU),
quick-GELU x * sigmoid(1.702 x) (quick-GeGLU, quick-GELU), and squared ReLU. Gated MLPs may clamp
their inputs and offset the linear branch, as GPT-OSS does:
    g = min(x W_gate, c),  u = clip(x W_up, -c, c),  h = act(g) * (u + offset).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


gelu_tanh = partial(F.gelu, approximate="tanh")

# name -> (activation, gated)
ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "swiglu": (F.silu, True),
    "geglu": (F.gelu, True),
    "geglu_tanh": (gelu_tanh, True),
    "quick_geglu": (quick_gelu, True),
    "gelu": (F.gelu, False),
    "gelu_tanh": (gelu_tanh, False),
    "quick_gelu": (quick_gelu, False),
    "squared_relu": (squared_relu, False),
}


def is_gated(activation: str) -> bool:
    return ACTIVATIONS[activation][1]


def gated(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor,
          clamp_value: Optional[float] = None, linear_offset: float = 0.0) -> torch.Tensor:
    """act(min(gate, c)) * (clip(up, -c, c) + offset); without c, act(gate) * (up + offset)."""
    if clamp_value is not None:
        gate = gate.clamp(max=clamp_value)
        up = up.clamp(-clamp_value, clamp_value)
    if linear_offset != 0.0:
        up = up + linear_offset
    return act(gate) * up


class MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, activation: str, *, bias: bool = False,
                 clamp_value: Optional[float] = None, linear_offset: float = 0.0):
        super().__init__()
        self.act, gated = ACTIVATIONS[activation]
        if not gated and (clamp_value is not None or linear_offset != 0.0):
            raise ValueError(f"clamp and linear offset need a gated activation, not {activation!r}")
        self.clamp_value, self.linear_offset = clamp_value, linear_offset
        self.w_gate = nn.Linear(hidden_size, ffn_size, bias=bias) if gated else None
        self.w_up = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.w_down = nn.Linear(ffn_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        if self.w_gate is None:
            return self.w_down(self.act(self.w_up(x)))
        if self.clamp_value is None and self.linear_offset == 0.0:  # the common gated MLP (SwiGLU), no helper call
            return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))
        return self.w_down(gated(self.act, self.w_gate(x), self.w_up(x), self.clamp_value, self.linear_offset))
