"""torch.compile per sublayer, in place (`nn.Module.compile`), so parameter names are unchanged."""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module) -> None:
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for layer in layers:
        layer.compile(dynamic=False)
