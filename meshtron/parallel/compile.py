"""torch.compile per sublayer, in place (`nn.Module.compile`), so parameter names are unchanged.

Runs after tensor/sequence parallelism and recompute and before FSDP (STYLE 3), as torchtitan does:
each sublayer is one graph, traced with its DTensor parameters and the TP plan's input/output
redistributions (all-gather / reduce-scatter along the sequence under SP, all-reduce otherwise), so
the norms, dropout and residual adds on sequence shards are compiled with the matmuls around them.
FSDP's all-gathers and reduce-scatters stay outside the graphs (its hooks are added afterwards).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.compat import is_view


def apply_compile(model: nn.Module) -> None:
    """Compile every sublayer of `model` (a GPTModel or a pipeline stage of one) in place."""
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for layer in layers:
        sharded = any(isinstance(p, DTensor) for p in layer.parameters())
        # A graph with collectives names its process group, and the two tp groups of TP2 x FSDP2 (with
        # recompute) get different names for otherwise equal graphs; the on-disk graph caches leave the
        # name out of the key (PyTorch 2.13), so a rank loaded the other group's graph and failed to
        # resolve its group. Sharded sublayers skip the caches (they recompile in every process).
        options = {"fx_graph_cache": False} if sharded else None  # also turns off AOTAutograd's cache
        if sharded and "forward" in vars(layer):  # recompute wrapped the forward in a checkpoint
            # a checkpoint inside a graph of DTensors fails at run time (PyTorch 2.13: AOTAutograd saves
            # the mesh among the tensors), so the checkpoint stays eager around the compiled norm and mixer
            layer.norm.compile(dynamic=False, options=options)
            layer.mixer.compile(dynamic=False, options=options)
        else:
            layer.compile(dynamic=False, options=options)
    embedding = getattr(model, "embedding", None)
    if embedding is not None and isinstance(embedding.weight, DTensor):
        embedding.register_forward_hook(_own_storage)


def _own_storage(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """The vocab-parallel embedding's output is `to_local()` of a DTensor: a view of the DTensor's local
    shard. Fed as is to a compiled sublayer, its gradient skips that `to_local` backward and reaches
    the all-reduce (or reduce-scatter) behind it as a plain tensor, which fails (PyTorch 2.13). One copy
    of (batch, seq, hidden) per forward gives the sublayer an input that owns its storage."""
    return out.clone() if isinstance(out, torch.Tensor) and is_view(out) else out
