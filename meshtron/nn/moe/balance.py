"""Training-side hooks of the MoE sublayers: the aux-loss gradient scale, the end-of-step statistics
(per-layer expert load, dropped fraction, balancing losses) and the expert-bias update of
auxiliary-loss-free balancing:
    load_i = tokens that chose expert i this step (all micro-batches, summed over data-parallel ranks)
    bias_i += rate * sign(mean_j load_j - load_i)      (under-loaded experts become likelier picks)
The statistics are sums, so the caller passes `reduce` (a sum over the ranks that saw different
tokens); every rank then applies the same bias update.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from meshtron.nn.moe.layer import MoELayer

Reduce = Optional[Callable[[torch.Tensor], torch.Tensor]]


def moe_layers(modules: nn.Module | Iterable[nn.Module]) -> list[tuple[str, MoELayer]]:
    """(short name, layer) for every MoE sublayer: 'L3' for the mixer of layers.3, else the module path."""
    parts = [modules] if isinstance(modules, nn.Module) else list(modules)
    found = []
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoELayer):
                match = re.search(r"layers\.(\d+)\.", name)
                found.append((f"L{match.group(1)}" if match else name, module))
    return found


@contextmanager
def moe_bookkeeping_paused(modules: nn.Module | Iterable[nn.Module]) -> Iterator[None]:
    """Forwards inside neither count statistics nor record or replay routing (e.g. a pipeline stage's
    shape inference on placeholder tensors)."""
    layers = [layer for _, layer in moe_layers(modules)]
    for layer in layers:
        layer.paused = True
    try:
        yield
    finally:
        for layer in layers:
            layer.paused = False


def set_aux_loss_scale(modules: nn.Module | Iterable[nn.Module], scale: float) -> None:
    """Gradient weight of each forward's aux loss (the trainer: 1 / number of forwards in the step
    summed over data-parallel ranks, so the step's objective adds the mean aux loss)."""
    for _, layer in moe_layers(modules):
        layer.aux_loss_scale = scale


def update_expert_bias(layer: MoELayer, load: torch.Tensor) -> None:
    bias = getattr(layer.router, "expert_bias", None)
    if bias is None:
        return
    rate = layer.router.bias_update_rate
    load = load.to(bias.device, torch.float32)
    bias.add_(rate * torch.sign(load.mean() - load))


def end_of_step(modules: nn.Module | Iterable[nn.Module], reduce: Reduce = None) -> dict[str, float]:
    """Reduce each layer's statistics of this step, update expert biases, reset, and return metrics:
    per layer `moe_load_max_L{i}` (busiest expert's load / mean load), `moe_dropped_L{i}`, and over
    layers `moe_aux_loss` / `moe_z_loss` (sum over layers of the per-forward mean), `moe_dropped_frac`,
    plus `moe_load_L{i}` lists (each expert's share of the choices)."""
    metrics: dict[str, float] = {}
    totals: dict[str, float] = {}
    chosen_all = dropped_all = 0.0
    for name, layer in moe_layers(modules):
        stats = layer.stats
        if stats.num_forwards == 0:
            continue
        names = sorted(stats.losses)
        device = stats.tokens_per_expert.device  # reduced where the tokens were counted (NCCL needs CUDA)
        packed = torch.cat([stats.tokens_per_expert, stats.num_dropped.reshape(1),
                            torch.tensor([stats.num_chosen, stats.num_forwards], dtype=torch.float64, device=device),
                            torch.stack([torch.as_tensor(stats.losses[n][0], device=device).double() for n in names])
                            if names else torch.zeros(0, dtype=torch.float64, device=device)])
        if reduce is not None:
            packed = reduce(packed)
        packed = packed.cpu()
        E = layer.num_experts
        load, (dropped, chosen, forwards), loss_sums = packed[:E], packed[E:E + 3].tolist(), packed[E + 3:]
        update_expert_bias(layer, load)
        share = load / max(float(load.sum()), 1.0)
        metrics[f"moe_load_max_{name}"] = float(share.max() * E)
        metrics[f"moe_dropped_{name}"] = dropped / max(chosen, 1.0)
        metrics[f"moe_load_{name}"] = [round(float(v), 4) for v in share]
        for n, s in zip(names, loss_sums.tolist()):
            totals[f"moe_{n}"] = totals.get(f"moe_{n}", 0.0) + s / forwards
        chosen_all, dropped_all = chosen_all + chosen, dropped_all + dropped
        stats.reset()
    if chosen_all:
        metrics["moe_dropped_frac"] = dropped_all / chosen_all
    return {**totals, **metrics}

