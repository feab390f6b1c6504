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


def hang_one_rank(rank: int, world_size: int, overrides: dict[str, str], hang_rank: int, hang_step: int) -> str:
    """Rank `hang_rank` stops forever before step `hang_step` (it never joins that step's collectives);
    the other ranks must fail within the timeout with a message naming it. Returns that message."""
    import time

    from meshtron.config.loader import load_config
    from meshtron.training import Trainer, TrainingError

    trainer = Trainer(load_config(overrides=overrides, world_size=world_size))
    if rank == hang_rank:
        next_batch = trainer.loader.next_global_batch

        def stuck():
            if trainer.step + 1 == hang_step:
                time.sleep(3600)
            return next_batch()

        trainer.loader.next_global_batch = stuck
    try:
        trainer.train()
    except TrainingError as e:
        return str(e)
    return "finished without error"
