"""MLP activations against their formulas written out: GELU (erf and tanh forms), quick-GELU,
squared ReLU, the gated variants, and GPT-OSS's clamp and linear offset."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.nn.mlp import ACTIVATIONS, MLP


def gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


FORMULAS = {
    "swiglu": lambda x: x / (1 + torch.exp(-x)),
    "geglu": gelu_erf,
    "geglu_tanh": gelu_tanh,
    "quick_geglu": lambda x: x / (1 + torch.exp(-1.702 * x)),
    "gelu": gelu_erf,
    "gelu_tanh": gelu_tanh,
    "quick_gelu": lambda x: x / (1 + torch.exp(-1.702 * x)),
    "squared_relu": lambda x: torch.clamp(x, min=0) ** 2,
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_mlp_equals_formula(name):
    torch.manual_seed(0)
    mlp = MLP(8, 12, name, bias=True).double()
    x = torch.randn(3, 4, 8, dtype=torch.float64) * 2
    act = FORMULAS[name]
    up = x @ mlp.w_up.weight.T + mlp.w_up.bias
    if "glu" in name:
        h = act(x @ mlp.w_gate.weight.T + mlp.w_gate.bias) * up
    else:
        assert mlp.w_gate is None
        h = act(up)
    torch.testing.assert_close(mlp(x), h @ mlp.w_down.weight.T + mlp.w_down.bias, atol=1e-12, rtol=0)


def test_gpt_oss_clamp_and_offset():
    """GPT-OSS: gate clamped above at 7, linear clamped to [-7, 7], out = quick_gelu(gate) * (linear + 1)."""
    torch.manual_seed(0)
    mlp = MLP(8, 12, "quick_geglu", clamp_value=7.0, linear_offset=1.0).double()
    x = torch.randn(5, 8, dtype=torch.float64) * 20  # large enough that both clamps bind
    gate, lin = x @ mlp.w_gate.weight.T, x @ mlp.w_up.weight.T
    assert (gate > 7).any() and (lin.abs() > 7).any()
    gate, lin = torch.where(gate > 7, 7.0, gate), torch.where(lin > 7, 7.0, torch.where(lin < -7, -7.0, lin))
    h = gate * torch.sigmoid(1.702 * gate) * (lin + 1.0)
    torch.testing.assert_close(mlp(x), h @ mlp.w_down.weight.T, atol=1e-12, rtol=0)


def test_clamp_needs_a_gated_activation():
    with pytest.raises(ValueError, match="gated"):
        MLP(8, 12, "gelu", clamp_value=7.0)
