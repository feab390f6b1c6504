"""Async checkpoint staging: host buffers are allocated once and reused by later saves (pinned, with
non-blocking copies, on CUDA); each checkpoint still holds the state as it was at its save call."""

from __future__ import annotations

import pytest
import torch

from meshtron.checkpoint import CheckpointManager, load_checkpoint
from meshtron.checkpoint.manager import staging_options
from tests.checkpoint.test_manager import model_and_opt, save


def tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) and tree.dim() > 0 else []


def recording_stage(manager):
    staged = []
    original = manager._stage

    def stage(state):
        out = original(state)
        staged.append(out)   # kept alive: a fresh allocation could not land on these addresses
        return out

    manager._stage = stage
    return staged


def test_staging_buffers_are_reused_across_saves(tmp_path):
    model, opt = model_and_opt(0)
    manager = CheckpointManager(tmp_path, keep_last=0, async_save=True)
    staged = recording_stage(manager)
    snapshots = []
    for step in (1, 2, 3):
        snapshots.append([p.detach().clone() for p in model.parameters()])
        save(manager, step, model, opt)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)   # training goes on while the save is written
    manager.wait()
    first = {t.data_ptr() for t in tensors(staged[0])}
    assert first and all({t.data_ptr() for t in tensors(s)} == first for s in staged[1:])
    for step, expected in zip((1, 2, 3), snapshots):   # reuse did not leak one save's values into another
        fresh, _ = model_and_opt(1)
        load_checkpoint(tmp_path / f"step_{step:08d}", fresh)
        assert all(torch.equal(a, b) for a, b in zip(expected, fresh.parameters()))


def test_pinned_with_non_blocking_copies_on_cuda_only():
    cuda, cpu = staging_options(True), staging_options(False)
    assert cuda.use_pinned_memory and cuda.use_non_blocking_copy
    assert not (cpu.use_pinned_memory or cpu.use_non_blocking_copy)
    for options in (cuda, cpu):   # staged before save() returns; never in shared memory
        assert not (options.use_async_staging or options.use_shared_memory)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_tensors_are_pinned_on_cuda(tmp_path):
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64, device="cuda")).sum().backward()
    opt.step()
    manager = CheckpointManager(tmp_path, async_save=True)
    staged = recording_stage(manager)
    save(manager, 1, model, opt)
    manager.wait()
    assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors(staged[0]) if t.numel() > 1)


def fsdp_async_rank(rank: int, world_size: int, overrides: dict[str, str], save_dir: str) -> dict:
    from meshtron.config.loader import load_config
    from meshtron.testing.parity import full_parameters
    from meshtron.training import Trainer

    trainer = Trainer(load_config(overrides={**overrides, "checkpoint.save": save_dir}, world_size=world_size))
    trainer.train()
    trainer.save()           # asynchronous: staged DTensor shards, written in a thread
    expected = full_parameters(trainer.model)
    trainer.checkpoints.wait()
    fresh = Trainer(load_config(overrides={**overrides, "checkpoint.load": save_dir}, world_size=world_size))
    got = full_parameters(fresh.model)
    return {"max_diff": max(float((expected[n] - got[n]).abs().max()) for n in expected)}


def test_async_save_of_fsdp_shards_round_trips(tmp_path):
    """DTensor shards go through the same staging (two gloo ranks): what loads is what was saved."""
    from meshtron.testing.multiprocess import run_ranks
    from tests.conftest import TINY

    overrides = {**TINY, "train.train_iters": "2", "checkpoint.save_at_end": "false", "checkpoint.async_save": "true",
                 "parallel.dp_shard": "2", "parallel.timeout_s": "60", "train.run_dir": str(tmp_path / "run")}
    results = run_ranks("tests.checkpoint.test_async_staging:fsdp_async_rank", 2, timeout_s=240,
                        overrides=overrides, save_dir=str(tmp_path / "ck"))
    assert [r["max_diff"] for r in results] == [0.0, 0.0]
