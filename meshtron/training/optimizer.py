"""Optimizer construction: Adam/AdamW or SGD, with weight decay only on matrices (never on norms,
biases or other 1-D parameters); optionally with a fraction of the states offloaded to the CPU
(training/offload.py)."""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config.schema import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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
