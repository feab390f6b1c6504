"""Run directories: a second command into a run directory resumes only when asked and otherwise is
refused in one line; SIGTERM/SIGINT save a checkpoint at the next step boundary and exit 143/130, and
resuming reaches the weights and losses of an uninterrupted run; the end-of-run summary line, the
loss curve (CSV, PNG) and step N/total with elapsed time and ETA."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.training import Trainer
from meshtron.training.interrupt import RunInterrupted
from meshtron.training.run_dir import save_interval
from tests.conftest import TINY

FLAGS = [arg for k, v in TINY.items() for arg in (f"--{k}", v)]


def records(run_dir, kind="train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_a_second_run_into_the_same_directory_is_refused_unless_it_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", *FLAGS, "--train.run_dir", str(run), "--train.train_iters", "2"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a run" in err
    assert "--checkpoint.load auto" in err and "--train.run_dir" in err   # both fixes named
    assert [r["step"] for r in records(run)] == [1, 2]                     # the old run is untouched
    # asked to resume: continues from step 2 to 4 (no step is logged twice)
    assert main([*argv[:-1], "4", "--checkpoint.load", "auto"]) == 0
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4]
    assert "resumed from" in capsys.readouterr().out


def test_an_empty_or_fresh_directory_is_not_a_run(tmp_path, tiny_config):
    from meshtron.training.run_dir import check_run_dir, existing_run

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    cfg = tiny_config()
    assert existing_run(cfg) is None
    check_run_dir(cfg)
    (tmp_path / "run" / "checkpoints" / "step_00000004").mkdir(parents=True)
    assert existing_run(cfg).endswith("step_00000004")


@pytest.mark.parametrize("iters, expected", [(4, 50), (1000, 100), (3000, 300), (100_000, 1000)])
def test_the_default_save_interval_is_a_tenth_of_the_run_within_50_to_1000(iters, expected):
    cfg = load_config(overrides={"train.train_iters": str(iters)})
    assert cfg.checkpoint.save_interval is None
    assert save_interval(cfg) == expected
    assert save_interval(load_config(overrides={"train.train_iters": str(iters),
                                                "checkpoint.save_interval": "0"})) == 0


class SignalAt(Trainer):
    """Sends itself `signum` right after step `at`, as a scheduler (or Ctrl-C) would mid-run."""

    def __init__(self, cfg, at: int, signum: int):
        self.at, self.signum = at, signum
        super().__init__(cfg)

    def train_step(self, micro_batches):
        result = super().train_step(micro_batches)
        if self.step == self.at:
            os.kill(os.getpid(), self.signum)
        return result


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_a_checkpoint_and_resuming_matches_an_uninterrupted_run(tmp_path, tiny_config, signum, code):
    common = {"train.train_iters": "6", "checkpoint.save_interval": "0", "checkpoint.save_at_end": "false"}
    straight = Trainer(tiny_config(**{**common, "train.run_dir": str(tmp_path / "straight")}))
    straight_history = straight.train()
    run = {**common, "train.run_dir": str(tmp_path / "run")}
    before = signal.getsignal(signum)
    with pytest.raises(RunInterrupted) as stop:
        SignalAt(tiny_config(**run), at=2, signum=signum).train()
    assert signal.getsignal(signum) == before   # the process's own handler is back
    assert stop.value.exit_code == code and "at step 2" in str(stop.value)
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    resumed = Trainer(tiny_config(**{**run, "checkpoint.load": "auto", "checkpoint.save_at_end": "true"}))
    assert resumed.step == 2
    history = resumed.train()
    assert [r.loss for r in history] == [r.loss for r in straight_history[2:]]
    final, reference = weights(resumed), weights(straight)
    assert all(torch.equal(final[k], reference[k]) for k in reference)


def test_the_cli_exits_143_after_sigterm_with_one_line(tmp_path, capsys, monkeypatch):
    import meshtron.training as training

    original = training.Trainer.train_step

    def step_then_signal(self, micro_batches):
        result = original(self, micro_batches)
        if self.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(training.Trainer, "train_step", step_then_signal)
    run = tmp_path / "run"
    assert main(["train", *FLAGS, "--train.run_dir", str(run), "--checkpoint.save_at_end", "false"]) == 143
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "stopped by SIGTERM at step 1" in err and "--checkpoint.load auto" in err
    assert "stopped by SIGTERM: step 1/4" in out and "step_00000001" in out
    assert (run / "checkpoints" / "step_00000001" / "manifest.json").is_file()


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import meshtron.training as training
    from meshtron.cli import main

    original = training.Trainer.train_step
    ready = Path(sys.argv[1])

    def train_step(self, micro_batches):
        result = original(self, micro_batches)
        if self.step == 3:   # tell the parent, then wait for its signal (at most a minute)
            ready.write_text("3")
            deadline = time.monotonic() + 60
            while self.stop.signum is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return result

    training.Trainer.train_step = train_step
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.slow
def test_sigterm_from_another_process_then_resume_reaches_the_uninterrupted_losses(tmp_path):
    """A real SIGTERM from outside (as a scheduler sends it) mid-run: exit 143 with a checkpoint at the
    step boundary; `--checkpoint.load auto` then logs the same losses as a run never interrupted."""
    argv = ["train", *FLAGS, "--train.train_iters", "6", "--checkpoint.save_interval", "0"]
    assert main([*argv, "--train.run_dir", str(tmp_path / "straight")]) == 0
    run, ready = tmp_path / "run", tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ready), *argv, "--train.run_dir", str(run)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=os.getcwd())
    while not ready.exists() and child.poll() is None:
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 143, err
    assert "stopped by SIGTERM at step 3" in err
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert main([*argv, "--train.run_dir", str(run), "--checkpoint.load", "auto"]) == 0
    straight = {r["step"]: r["loss"] for r in records(tmp_path / "straight")}
    resumed = {r["step"]: r["loss"] for r in records(run)}
    assert resumed == straight


def test_summary_line_and_loss_curve(tmp_path, tiny_config, capsys):
    cfg = tiny_config(**{"train.eval_interval": "3", "train.eval_iters": "2", "logger.log_interval": "2"})
    trainer = Trainer(cfg)
    history = trainer.train()
    out = capsys.readouterr().out
    run = tmp_path / "run"
    valid = records(run, "valid")
    assert [r["step"] for r in valid] == [3, 4]   # step 4: the final weights are evaluated for the summary
    summary = [line for line in out.splitlines() if line.startswith("done: ")]
    assert len(summary) == 1
    assert summary[0].startswith("done: step 4/4 in ")
    assert f"train loss {history[-1].loss:.4f}" in summary[0]
    assert f"valid loss {valid[-1]['loss']:.4f} (step 4)" in summary[0]
    assert f"checkpoint {run / 'checkpoints' / 'step_00000004'}" in summary[0]
    # the CSV holds each logged train loss and each valid loss by step, as metrics.jsonl has them
    with open(run / "loss_curve.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    expected = {r["step"]: (r["loss"], "") for r in records(run)}
    for r in valid:
        expected[r["step"]] = (expected.get(r["step"], ("",))[0], r["loss"])
    assert {int(r["step"]): (float(r["train_loss"]) if r["train_loss"] else "",
                             float(r["valid_loss"]) if r["valid_loss"] else "") for r in rows} == expected
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (run / "loss_curve.png").exists()
    else:
        assert (run / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_lines_show_step_of_total_elapsed_and_eta(tiny_config, capsys):
    Trainer(tiny_config(**{"checkpoint.save_at_end": "false"})).train()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[train]")]
    assert [line.split(" | ")[0] for line in lines] == [f"[train] step {k}/4" for k in range(1, 5)]
    assert all(" | elapsed " in line for line in lines)
    assert all(" | eta " in line for line in lines[:-1]) and " | eta " not in lines[-1]   # none once done


def test_checkpoints_are_saved_at_the_interval(tmp_path, tiny_config):
    Trainer(tiny_config(**{"checkpoint.save_interval": "2", "checkpoint.save_at_end": "false",
                           "checkpoint.keep_last": "0"})).train()
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_00000002", "step_00000004"]


def signal_on_one_rank(rank: int, world_size: int, run_dir: str) -> tuple[int, int]:
    """Rank 1 alone gets SIGTERM after step 2: both ranks stop after step 2 (they agree through one
    all-reduce) and save one checkpoint together. -> (exit code, step) of this rank."""
    overrides = {**TINY, "train.run_dir": run_dir, "checkpoint.save_at_end": "false", "checkpoint.save_interval": "0",
                 "train.train_iters": "6", "parallel.timeout_s": "120"}
    trainer = SignalAt(load_config(overrides=overrides, world_size=world_size), at=2 if rank == 1 else -1,
                       signum=signal.SIGTERM)
    try:
        trainer.train()
    except RunInterrupted as stop:
        return stop.exit_code, trainer.step
    return 0, trainer.step


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    from meshtron.testing.multiprocess import run_ranks

    results = run_ranks("tests.training.test_run_dir:signal_on_one_rank", 2, timeout_s=300, run_dir=str(tmp_path / "run"))
    assert results == [(143, 2), (143, 2)]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
