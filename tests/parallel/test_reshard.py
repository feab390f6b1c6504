"""A checkpoint saved under one layout loads under another (model, optimizer state, data position)
and training continues as if uninterrupted."""

from __future__ import annotations

import pytest

from meshtron.config.loader import load_config
from meshtron.testing.multiprocess import run_ranks
from meshtron.training import Trainer

from .test_layouts import BASE

# 4 kv heads so that TP4 divides them; SGD with momentum: resharded optimizer state without Adam's
# amplification of 1e-8 layout noise into parameter differences (see PLATFORM.md)
COMMON = {**BASE, "model.num_query_groups": "4", "train.train_iters": "6", "scheduler.decay_steps": "6",
          "optimizer.type": "sgd", "optimizer.sgd_momentum": "0.9", "optimizer.lr": "0.05",
          "parallel.timeout_s": "60"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(uninterrupted single-process losses, checkpoint saved at step 3 under TP2 x FSDP2)."""
    root = tmp_path_factory.mktemp("reshard")
    ref = Trainer(load_config(overrides={**COMMON, "train.run_dir": str(root / "ref")}, world_size=1)).train()
    overrides = {**COMMON, "train.train_iters": "3", "parallel.tp": "2", "parallel.dp_shard": "2",
                 "train.run_dir": str(root / "tp2fsdp2"), "checkpoint.save_at_end": "true",
                 "checkpoint.save": str(root / "ck")}
    run_ranks("meshtron.testing.parity:train_and_report", 4, timeout_s=240, overrides=overrides)
    return [r.loss for r in ref], root / "ck"


def resumed(saved, tmp_path, world, extra):
    ref_losses, ck = saved
    overrides = {**COMMON, **extra, "checkpoint.load": str(ck), "train.run_dir": str(tmp_path / "run")}
    if world == 1:
        losses = [r.loss for r in Trainer(load_config(overrides=overrides, world_size=1)).train()]
    else:
        losses = run_ranks("meshtron.testing.parity:train_and_report", world, timeout_s=240,
                           overrides=overrides)[0]["losses"]
    assert losses == pytest.approx(ref_losses[3:], abs=1e-6, rel=0)


def test_tp2_fsdp2_to_one_process(saved, tmp_path):
    resumed(saved, tmp_path, 1, {})


def test_tp2_fsdp2_to_fsdp4(saved, tmp_path):
    resumed(saved, tmp_path, 4, {"parallel.dp_shard": "4"})


@pytest.mark.slow
def test_tp2_fsdp2_to_tp4(saved, tmp_path):
    resumed(saved, tmp_path, 4, {"parallel.tp": "4"})


@pytest.mark.slow
def test_tp2_fsdp2_to_tp2_dp2_hsdp(saved, tmp_path):
    resumed(saved, tmp_path, 4, {"parallel.tp": "2", "parallel.dp_replicate": "2", "parallel.dp_shard": "1"})
