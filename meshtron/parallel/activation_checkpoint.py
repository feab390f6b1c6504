"""Activation recompute: a checkpointed sublayer keeps only its input in forward and recomputes
its activations during backward (non-reentrant `torch.utils.checkpoint`).

`full` recomputes every sublayer; `selective` only the sequence mixers: attention sublayers, whose
score/softmax activations grow with the sequence length, and Mamba sublayers, whose chunked scan
keeps chunk x chunk decay and score matrices per head; their recompute is cheap relative to the memory.
The sublayer's own `forward` is wrapped on the instance, so parameter names do not change.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtron.models.blocks import SUBLAYERS

SELECTIVE = tuple(s for s, kind in SUBLAYERS.items() if kind.selective_recompute)  # attention and Mamba today


def apply_activation_checkpoint(model: nn.Module, mode: str) -> None:
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for layer in layers:
        if mode == "full" or (mode == "selective" and layer.symbol in SELECTIVE):
            inner = layer.forward
            layer.forward = lambda *args, _inner=inner, **kw: checkpoint(_inner, *args, use_reentrant=False, **kw)
