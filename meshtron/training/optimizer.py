"""Optimizer construction: Adam/AdamW or SGD, with weight decay only on weight matrices (never on norms,
biases or the SSM's per-head scalars); optionally with a fraction of the states offloaded to the CPU
(training/offload.py)."""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config.schema import OptimizerConfig
from meshtron.nn.mamba import GatedRMSNorm
from meshtron.nn.moe.experts import GroupedExperts
from meshtron.nn.norm import LayerNorm, RMSNorm

# Every parameter of these modules is a norm gain or shift (incl. per-head q/k norms and Mamba's gated norm).
NORM_MODULES = (RMSNorm, LayerNorm, GatedRMSNorm, nn.LayerNorm, nn.RMSNorm)
# Mamba's A_log and D, and learned softmax sinks: per-head scalars, not weight matrices.
NO_DECAY_LEAVES = frozenset({"A_log", "D", "sinks"})
EXPERT_BIASES = frozenset({"b_gate", "b_up", "b_down"})


def decays(module: nn.Module, leaf: str, param: torch.Tensor) -> bool:
    """Whether parameter `leaf` of `module` gets weight decay: the one rule, by role, not by shape.

    No decay on: norm weights and biases; every bias (`*.bias`, `dt_bias`, the stacked per-expert
    biases `b_gate`/`b_up`/`b_down`, which are 2-D); Mamba's `A_log`, `D`; attention sinks; any other
    1-D parameter. Decay on everything else: linear and expert weight matrices, embeddings, the output
    head, the router and the depthwise convolution weights. This is Megatron-LM's default rule
    (`name.endswith(".bias") or param is 1-D`, which covers A_log/D/dt_bias by shape) made explicit
    for the 2-D stacked expert biases that a shape test misses.
    """
    if isinstance(module, NORM_MODULES):
        return False
    if leaf.endswith("bias") or leaf in NO_DECAY_LEAVES:
        return False
    if isinstance(module, GroupedExperts) and leaf in EXPERT_BIASES:
        return False
    return param.ndim >= 2


def decay_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names with weight decay, names without) of the trainable parameters, in model order."""
    decay, no_decay, seen = [], [], set()
    for module_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:  # a shared (tied) parameter is listed once
                seen.add(id(p))
                name = f"{module_name}.{leaf}" if module_name else leaf
                (decay if decays(module, leaf, p) else no_decay).append(name)
    return decay, no_decay


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = decay_names(model)
    params = dict(model.named_parameters())
    return [{"params": [params[n] for n in decay], "weight_decay": weight_decay},
            {"params": [params[n] for n in no_decay], "weight_decay": 0.0}]


def optimizer_class(cfg: OptimizerConfig) -> tuple[type, dict]:
    """(class, keyword arguments) of the configured optimizer."""
    if cfg.type == "sgd":
        return torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.sgd_momentum}
    cls = torch.optim.AdamW if cfg.decoupled_weight_decay else torch.optim.Adam
    return cls, {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    cls, kwargs = optimizer_class(cfg)
    if cfg.offload_fraction > 0:
        from meshtron.training.offload import OffloadOptimizer

        return OffloadOptimizer(groups, cls, kwargs, cfg.offload_fraction, overlap=cfg.offload_overlap)
    return cls(groups, **kwargs)
