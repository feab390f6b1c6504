"""Rank functions for layout-parity tests: train with a config on every rank and report what the
single-process run is compared with (per-step losses and grad norms, full parameters after training)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, gathered to a full tensor (a collective on sharded axes)."""
    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = value.detach().to("cpu", copy=True)
    return out


def train_and_report(rank: int, world_size: int, overrides: dict[str, str]) -> dict[str, Any]:
    from meshtron.config.loader import load_config
    from meshtron.training import Trainer

    cfg = load_config(overrides=overrides, world_size=world_size)
    trainer = Trainer(cfg)
    history = trainer.train()
    return {"losses": [r.loss for r in history], "grad_norms": [r.grad_norm for r in history],
            "params": full_parameters(trainer.model)}
