"""A checkpoint saved under one layout loads under another (model, optimizer state, data position)
and training continues as if uninterrupted."""

from __future__ import annotations

import pytest
import torch

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


def full_optimizer_state(rank: int, world_size: int, overrides: dict[str, str]) -> dict:
    """Build the trainer (loading `checkpoint.load` if set), train its iterations, and return the Adam
    state gathered to full tensors, keyed by parameter name (the same names under every layout)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    trainer = Trainer(load_config(overrides=overrides, world_size=world_size))
    trainer.train()
    state = get_optimizer_state_dict(trainer.model, trainer.optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # full_state_dict with cpu_offload: gathered on rank 0, empty on the others
    return {name: {k: v.clone() for k, v in s.items()} for name, s in state.get("state", {}).items()}


ADAM = {**COMMON, "optimizer.type": "adam", "optimizer.lr": "1e-3", "train.train_iters": "3"}


@pytest.mark.slow
def test_adam_state_reshards_to_another_layout(tmp_path):
    """Adam's exp_avg, exp_avg_sq and step saved at TP2 x FSDP2, loaded at FSDP4 and in one process,
    equal the saved ones gathered to full (resharding moves values, so they are bit-exact)."""
    ck = tmp_path / "ck"
    saved = run_ranks("tests.parallel.test_reshard:full_optimizer_state", 4, timeout_s=240,
                      overrides={**ADAM, "parallel.tp": "2", "parallel.dp_shard": "2", "checkpoint.save_at_end": "true",
                                 "checkpoint.save": str(ck), "train.run_dir": str(tmp_path / "save")})[0]
    assert saved and all(set(s) == {"exp_avg", "exp_avg_sq", "step"} for s in saved.values())
    load = {**ADAM, "checkpoint.load": str(ck)}  # train_iters 3: loads at step 3 and trains no further
    fsdp4 = run_ranks("tests.parallel.test_reshard:full_optimizer_state", 4, timeout_s=240,
                      overrides={**load, "parallel.dp_shard": "4", "train.run_dir": str(tmp_path / "fsdp4")})
    single = full_optimizer_state(0, 1, {**load, "train.run_dir": str(tmp_path / "one")})
    for loaded in (fsdp4[0], single):
        assert set(loaded) == set(saved)
        for name, s in saved.items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(loaded[name][key], s[key], atol=0, rtol=0, msg=f"{name}.{key}")
    assert float(next(iter(saved.values()))["step"]) == 3


@pytest.mark.slow
def test_cp2_checkpoint_resumes_in_one_process(saved, tmp_path):
    """Save under context parallelism (CP2, the sequence split over 2 ranks), resume in one process."""
    ref_losses, _ = saved
    ck = tmp_path / "ck_cp2"
    run_ranks("meshtron.testing.parity:train_and_report", 2, timeout_s=240,
              overrides={**COMMON, "train.train_iters": "3", "parallel.cp": "2", "checkpoint.save_at_end": "true",
                         "checkpoint.save": str(ck), "train.run_dir": str(tmp_path / "cp2")})
    resumed((ref_losses, ck), tmp_path, 1, {})


@pytest.mark.slow
def test_pp2_tied_checkpoint_resumes_in_one_process(tmp_path):
    """Tied embeddings under PP2: both stages hold `embedding.weight` (the last stage's copy), saved once;
    the checkpoint resumes in one process (one tied matrix) with the uninterrupted losses."""
    tied = {**COMMON, "model.tie_word_embeddings": "true"}
    ref = [r.loss for r in Trainer(load_config(overrides={**tied, "train.run_dir": str(tmp_path / "ref")},
                                               world_size=1)).train()]
    ck = tmp_path / "ck_pp2"
    run_ranks("meshtron.testing.parity:train_and_report", 2, timeout_s=240,
              overrides={**tied, "train.train_iters": "3", "parallel.pp": "2", "checkpoint.save_at_end": "true",
                         "checkpoint.save": str(ck), "train.run_dir": str(tmp_path / "pp2")})
    overrides = {**tied, "checkpoint.load": str(ck), "train.run_dir": str(tmp_path / "run")}
    losses = [r.loss for r in Trainer(load_config(overrides=overrides, world_size=1)).train()]
    assert losses == pytest.approx(ref[3:], abs=1e-6, rel=0)


def test_pp2_checkpoint_resumes_under_pp2(tmp_path):
    """Each stage's optimizer settings (lr, momentum of its own parameters) survive a PP2 save and load:
    the optimizer state is saved flattened by parameter name, not as one rank's param_groups list."""
    ref = [r.loss for r in Trainer(load_config(overrides={**COMMON, "train.run_dir": str(tmp_path / "ref")},
                                               world_size=1)).train()]
    pp2 = {**COMMON, "parallel.pp": "2"}
    ck = tmp_path / "ck_pp2"
    run_ranks("meshtron.testing.parity:train_and_report", 2, timeout_s=240,
              overrides={**pp2, "train.train_iters": "3", "checkpoint.save_at_end": "true",
                         "checkpoint.save": str(ck), "train.run_dir": str(tmp_path / "pp2")})
    losses = run_ranks("meshtron.testing.parity:train_and_report", 2, timeout_s=240,
                       overrides={**pp2, "checkpoint.load": str(ck), "train.run_dir": str(tmp_path / "run")})[0]["losses"]
    assert losses == pytest.approx(ref[3:], abs=1e-6, rel=0)
