"""NVTX ranges (profile.nvtx) with a recording stand-in for `torch.cuda.nvtx`, since the tests run
without a GPU: the trainer pushes and pops the expected, properly nested names, including the
communication ranges of a 2-rank FSDP run."""

from __future__ import annotations

import types

import torch

from meshtron.testing.multiprocess import run_ranks
from meshtron.training.profiling import Ranges

from ..parallel.test_layouts import BASE


def recording_nvtx(events: list[tuple[str, str]]) -> types.SimpleNamespace:
    def range_push(name: str) -> None:
        events.append(("push", name))

    def range_pop() -> None:
        events.append(("pop", ""))

    return types.SimpleNamespace(range_push=range_push, range_pop=range_pop)


def test_ranges_use_nvtx_only_when_asked_and_cuda_is_present(monkeypatch):
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(torch.cuda, "nvtx", recording_nvtx(events))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with Ranges(nvtx=True)("forward"):
        pass
    assert events == []  # no CUDA: profiler ranges only
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with Ranges(nvtx=False)("forward"):
        pass
    assert events == []
    ranges = Ranges(nvtx=True)
    with ranges("forward"), ranges("communication"):
        pass
    assert events == [("push", "forward"), ("push", "communication"), ("pop", ""), ("pop", "")]


def nvtx_names_of_training(rank: int, world_size: int, overrides: dict[str, str]) -> list[tuple[str, str]]:
    from meshtron.config.loader import load_config
    from meshtron.training import Trainer

    trainer = Trainer(load_config(overrides=overrides, world_size=world_size))
    events: list[tuple[str, str]] = []
    torch.cuda.nvtx = recording_nvtx(events)  # this forked rank only
    trainer.ranges.nvtx = True  # as if on CUDA with profile.nvtx true
    trainer.train()
    return events


def test_trainer_nvtx_ranges_under_fsdp(tmp_path):
    overrides = {**BASE, "parallel.dp_shard": "2", "train.train_iters": "2", "profile.nvtx": "true",
                 "train.run_dir": str(tmp_path / "run"), "parallel.timeout_s": "60"}
    for events in run_ranks("tests.training.test_profiling_nvtx:nvtx_names_of_training", 2, timeout_s=180,
                            overrides=overrides):
        depth, stack = 0, []
        for kind, name in events:
            if kind == "push":
                stack.append(name)
            else:
                stack.pop()
            depth = max(depth, len(stack))
        assert stack == []  # every range was closed
        pushed = [name for kind, name in events if kind == "push"]
        # 2 steps x 2 micro-batches of forward and backward; the token count, loss sum and grad-norm
        # reductions are communication ranges
        assert pushed.count("forward") == 4 and pushed.count("backward") == 4
        assert {"data", "forward_backward", "optimizer", "grad_norm", "communication"} <= set(pushed)
        assert pushed.count("communication") >= 2 * 3
        assert depth >= 2  # forward inside forward_backward


def test_trainer_nvtx_ranges_under_pipeline(tmp_path):
    """PP2 (1f1b): every stage's forward of every micro-batch is a "forward" range inside the schedule's
    "pipeline" range (backward runs inside the schedule, under "pipeline")."""
    overrides = {**BASE, "parallel.pp": "2", "parallel.pp_schedule": "1f1b", "train.train_iters": "2",
                 "profile.nvtx": "true", "train.run_dir": str(tmp_path / "run"), "parallel.timeout_s": "60"}
    for events in run_ranks("tests.training.test_profiling_nvtx:nvtx_names_of_training", 2, timeout_s=180,
                            overrides=overrides):
        stack, forwards_in_pipeline = [], 0
        for kind, name in events:
            if kind == "push":
                forwards_in_pipeline += name == "forward" and "pipeline" in stack
                stack.append(name)
            else:
                stack.pop()
        assert stack == []
        # 2 steps x 4 micro-batches per stage (the first step's shape inference may add one)
        assert forwards_in_pipeline >= 2 * 4
        assert "communication" in [name for _, name in events]
