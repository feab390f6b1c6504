"""Checkpoints written before the pickle-free format: trainer_state.pt (torch.save) and manifests
without hashes. A trainer_state.pt that PyTorch's weights_only loader accepts still loads (with a
warning for the hash-less manifest); an old trainer state, whose numpy RNG arrays that loader
refuses, is refused in one line naming `meshtron checkpoint upgrade`, after which it resumes exactly."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint import CheckpointError, CheckpointManager, load_checkpoint, upgrade_checkpoint
from meshtron.checkpoint.manager import step_dir_name
from meshtron.checkpoint.state_io import read_trainer_state
from meshtron.cli import main
from tests.checkpoint.test_safe_loading import Payload, small_model


def make_old(step_dir: Path, state: dict) -> None:
    """Turn a checkpoint into what the code before issue 16 wrote: trainer_state.pt by torch.save and
    a manifest of sizes only."""
    for name in ("trainer_state.json", "trainer_state.safetensors"):
        (step_dir / name).unlink()
    torch.save(state, step_dir / "trainer_state.pt")
    manifest = json.loads((step_dir / "manifest.json").read_text())
    files = {str(f.relative_to(step_dir)): f.stat().st_size for f in sorted(step_dir.rglob("*"))
             if f.is_file() and f.name != "manifest.json"}
    (step_dir / "manifest.json").write_text(json.dumps({"step": manifest["step"], "files": files}))


def losses(history):
    return [r.loss for r in history]


def test_old_trainer_state_is_refused_then_upgraded_and_resumes_exactly(tiny_config, tmp_path, capsys):
    from meshtron.training import Trainer

    common = {"model.hidden_dropout": "0.1", "train.train_iters": "4", "scheduler.decay_steps": "4"}
    straight = Trainer(tiny_config(**{**common, "checkpoint.save_at_end": "false"})).train()
    Trainer(tiny_config(**{**common, "train.train_iters": "2", "checkpoint.save": str(tmp_path / "ck")})).train()
    step_dir = tmp_path / "ck" / step_dir_name(2)
    make_old(step_dir, read_trainer_state(step_dir))  # the same values, as the old code pickled them

    resume = tiny_config(**{**common, "checkpoint.load": str(tmp_path / "ck"), "checkpoint.save": str(tmp_path / "c2")})
    with pytest.raises(CheckpointError) as err:
        Trainer(resume)
    capsys.readouterr()
    assert "\n" not in str(err.value)
    assert f"`meshtron checkpoint upgrade {step_dir}`" in str(err.value)

    assert main(["checkpoint", "upgrade", str(tmp_path / "ck")]) == 0
    assert capsys.readouterr().out == f"{step_dir}: upgraded\n"
    assert not (step_dir / "trainer_state.pt").exists()
    assert json.loads((step_dir / "manifest.json").read_text())["format"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # hashes now: no warning
        resumed = Trainer(resume).train()
    assert losses(resumed) == losses(straight)[2:]  # bit for bit
    capsys.readouterr()
    assert main(["checkpoint", "upgrade", str(step_dir)]) == 0
    assert capsys.readouterr().out == f"{step_dir}: already current\n"


def test_weights_only_state_and_hashless_manifest_load_with_a_warning(tmp_path):
    """A model-only checkpoint converted from Hugging Face before issue 16 holds a trainer state of
    plain values, which the weights_only loader reads; its manifest has no hashes: loaded, warned."""
    model, _ = small_model()
    CheckpointManager(tmp_path).save(0, model, None, {}, "model: {}\n")
    step_dir = tmp_path / step_dir_name(0)
    make_old(step_dir, {"step": 0, "model_only": True, "source": "/models/x"})
    fresh, fresh_opt = small_model()
    with pytest.warns(UserWarning, match="manifest without sha256 hashes"):
        state = load_checkpoint(tmp_path, fresh, fresh_opt)
    assert state == {"step": 0, "model_only": True, "source": "/models/x"}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_upgrade_refuses_a_crafted_trainer_state(tmp_path):
    """The upgrade admits numpy's array reconstruction on top of weights_only, nothing more: a payload
    in trainer_state.pt is refused there too and never runs."""
    model, opt = small_model()
    CheckpointManager(tmp_path).save(1, model, opt, {}, "model: {}\n")
    step_dir = tmp_path / step_dir_name(1)
    marker = tmp_path / "pwned"
    make_old(step_dir, {"step": 1, "boom": Payload(f"touch {marker}")})
    with pytest.raises(CheckpointError, match="trainer_state.pt holds posix.system, which a meshtron trainer state "
                                              "never holds; not converted"):
        upgrade_checkpoint(step_dir)
    assert not marker.exists()
    assert (step_dir / "trainer_state.pt").exists()  # left as it was
    with pytest.raises(CheckpointError, match="trainer_state.pt holds posix.system") as err:
        load_checkpoint(step_dir, *small_model())  # loading names the refused global, not the upgrade
    assert "meshtron checkpoint upgrade" not in str(err.value) and not marker.exists()


def test_upgrade_of_something_else_is_one_line(tmp_path, capsys):
    assert main(["checkpoint", "upgrade", str(tmp_path / "nope")]) == 1
    assert main(["checkpoint", "upgrade", str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: checkpoint {str(tmp_path / 'nope')!r} does not exist",
                   f"error: {str(tmp_path)!r} holds no checkpoint to upgrade"]
