"""Checkpoints: a crash in the middle of a save keeps the previous one loadable with `latest` on it;
truncated or missing checkpoints are reported in one line; pruning keeps the newest N."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from meshtron.checkpoint import CheckpointError, CheckpointManager, load_checkpoint, resolve_checkpoint
from meshtron.checkpoint.manager import step_dir_name


def model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def save(manager, step, model, opt, **kw):
    manager.save(step, model, opt, {"step": step}, "model: {}\n", **kw)


def test_round_trip_restores_model_optimizer_and_state(tmp_path):
    model, opt = model_and_opt(0)
    save(CheckpointManager(tmp_path), 5, model, opt)
    fresh, fresh_opt = model_and_opt(1)
    state = load_checkpoint(tmp_path, fresh, fresh_opt)
    assert state == {"step": 5}
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], fresh_opt.state[b]["exp_avg_sq"])


@pytest.mark.parametrize("form", ["flattened", "nested"])
def test_both_optimizer_state_forms_load(tmp_path, monkeypatch, form):
    """Checkpoints save the optimizer state flattened by parameter name; the nested form of older
    checkpoints (one param_groups list) still loads, settings (lr, betas) included."""
    from meshtron.checkpoint import manager

    if form == "nested":
        monkeypatch.setattr(manager, "OPTIONS", manager.NESTED)
    model, opt = model_and_opt(0)
    opt.param_groups[0]["lr"] = 0.025
    save(CheckpointManager(tmp_path), 5, model, opt)
    monkeypatch.undo()
    keys = manager.dcp.FileSystemReader(str(tmp_path / step_dir_name(5))).read_metadata().state_dict_metadata
    assert ("optimizer.param_groups.0.params" in keys) == (form == "nested")
    fresh, fresh_opt = model_and_opt(1)
    load_checkpoint(tmp_path, fresh, fresh_opt)
    assert fresh_opt.param_groups[0]["lr"] == 0.025 and fresh_opt.param_groups[0]["betas"] == (0.9, 0.999)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[a]["exp_avg"], fresh_opt.state[b]["exp_avg"])


def test_exception_inside_writer_keeps_previous(tmp_path):
    model, opt = model_and_opt(0)
    manager = CheckpointManager(tmp_path)
    save(manager, 1, model, opt)

    def crash(tmp_dir):
        raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="simulated"):
        save(manager, 2, model, opt, before_finalize=crash)
    assert (tmp_path / "latest").read_text().strip() == step_dir_name(1)
    assert resolve_checkpoint(tmp_path).name == step_dir_name(1)
    assert not (tmp_path / step_dir_name(2)).exists()
    assert load_checkpoint(tmp_path, *model_and_opt(3)) == {"step": 1}
    save(manager, 3, model, opt)  # the leftover temporary directory does not get in the way
    assert resolve_checkpoint(tmp_path).name == step_dir_name(3)


def test_process_killed_mid_save_keeps_previous(tmp_path):
    # A real process dies (os._exit, no cleanup) after DCP wrote part of checkpoint 2.
    script = textwrap.dedent(f"""
        import os, torch
        import torch.distributed.checkpoint as dcp
        from meshtron.checkpoint import CheckpointManager
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward(); opt.step()
        manager = CheckpointManager({str(tmp_path)!r})
        manager.save(1, model, opt, {{"step": 1}}, "")
        real_save = dcp.save
        def dying_save(state, checkpoint_id, **kw):
            real_save(state, checkpoint_id=checkpoint_id, **kw)
            with open(os.path.join(checkpoint_id, "__0_0.distcp"), "r+b") as f:
                f.truncate(10)  # a half-written shard
            os._exit(9)
        dcp.save = dying_save
        manager.save(2, model, opt, {{"step": 2}}, "")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert (tmp_path / "latest").read_text().strip() == step_dir_name(1)
    assert (tmp_path / f".tmp-{step_dir_name(2)}").exists()  # the torn write is left aside
    model = torch.nn.Linear(4, 4)
    assert load_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters())) == {"step": 1}


def test_truncated_file_detected_before_loading(tmp_path):
    model, opt = model_and_opt(0)
    save(CheckpointManager(tmp_path), 1, model, opt)
    shard = next((tmp_path / step_dir_name(1)).glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    fresh, fresh_opt = model_and_opt(1)
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError, match="is truncated: __0_0.distcp has"):
        load_checkpoint(tmp_path, fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))  # nothing half-loaded


def test_missing_and_incomplete_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is not a complete checkpoint"):
        resolve_checkpoint(tmp_path / "empty")


def test_shape_mismatch_is_one_line(tmp_path):
    model, opt = model_and_opt(0)
    save(CheckpointManager(tmp_path), 1, model, opt)
    other = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))
    with pytest.raises(CheckpointError, match="does not match this model") as err:
        load_checkpoint(tmp_path, other)
    assert "\n" not in str(err.value)


def test_keep_last_prunes_oldest(tmp_path):
    model, opt = model_and_opt(0)
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        save(manager, step, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [step_dir_name(3), step_dir_name(4)]


def test_async_save_snapshots_state_at_call_time(tmp_path):
    model, opt = model_and_opt(0)
    manager = CheckpointManager(tmp_path, async_save=True)
    expected = [p.detach().clone() for p in model.parameters()]
    save(manager, 1, model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the save is written
    manager.wait()
    fresh, _ = model_and_opt(1)
    load_checkpoint(tmp_path, fresh)
    assert all(torch.equal(a, b) for a, b in zip(expected, fresh.parameters()))
