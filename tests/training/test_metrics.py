"""Metric sinks: TensorBoard and W&B (stand-in modules) receive exactly the JSONL metrics, and a
missing 'track' extra is a one-line config error raised before anything is built."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

from meshtron.cli import main
from meshtron.config import ConfigError, load_config
from meshtron.training import Trainer


class FakeSummaryWriter:
    instances: list[FakeSummaryWriter] = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.closed = log_dir, [], False
        FakeSummaryWriter.instances.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


class FakeWandbRun:
    def __init__(self, **kwargs):
        self.init_kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, values, step):
        self.logged.append((dict(values), step))

    def finish(self):
        self.finished = True


def stand_in_trackers(monkeypatch) -> list[FakeWandbRun]:
    FakeSummaryWriter.instances.clear()
    tb = types.ModuleType("torch.utils.tensorboard")
    tb.SummaryWriter = FakeSummaryWriter
    runs: list[FakeWandbRun] = []
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: runs.append(FakeWandbRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("WANDB_MODE", "unset")
    monkeypatch.delenv("WANDB_MODE")
    return runs


def expected_scalars(jsonl_path) -> list[tuple[str, float, int]]:
    """What every numeric (non-bool) metric of every JSONL record must become: (kind/name, value, step)."""
    out = []
    for line in open(jsonl_path):
        record = json.loads(line)
        kind, step = record.pop("kind"), record.pop("step")
        record.pop("time")
        out += [(f"{kind}/{k}", v, step) for k, v in record.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return out


def test_tensorboard_and_wandb_receive_the_jsonl_metrics(tiny_config, monkeypatch):
    runs = stand_in_trackers(monkeypatch)
    cfg = tiny_config(**{"logger.tensorboard": "true", "logger.wandb": "true", "logger.wandb_project": "proj",
                         "train.train_iters": "3", "train.eval_interval": "2", "train.eval_iters": "1",
                         "checkpoint.save_at_end": "false"})
    Trainer(cfg, echo=False).train()
    expected = expected_scalars(f"{cfg.train.run_dir}/metrics.jsonl")
    names = {tag for tag, _, _ in expected}
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu", "valid/loss", "valid/ppl"} <= names
    assert [s for t, _, s in expected if t == "train/loss"] == [1, 2, 3]

    (writer,) = FakeSummaryWriter.instances
    assert writer.log_dir == f"{cfg.train.run_dir}/tensorboard" and writer.closed
    assert writer.scalars == expected

    (run,) = runs
    assert run.init_kwargs["project"] == "proj" and run.init_kwargs["dir"] == cfg.train.run_dir
    assert run.init_kwargs["config"]["train"]["train_iters"] == 3 and run.finished
    assert [(tag, value, step) for values, step in run.logged for tag, value in values.items()] == expected
    assert run.init_kwargs["mode"] == "offline" and "WANDB_MODE" not in os.environ  # offline unless asked


@pytest.mark.parametrize("env, field, expected", [(None, "null", "offline"), ("online", "null", "online"),
                                                  ("online", "offline", "offline"), (None, "online", "online")])
def test_wandb_mode_follows_config_then_environment(env, field, expected, tiny_config, monkeypatch):
    runs = stand_in_trackers(monkeypatch)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    if env:
        monkeypatch.setenv("WANDB_MODE", env)
    Trainer(tiny_config(**{"train.train_iters": "1", "logger.wandb": "true", "logger.wandb_mode": field,
                           "checkpoint.save_at_end": "false"})).train()
    assert runs[0].init_kwargs["mode"] == expected


@pytest.mark.parametrize("field, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_missing_track_extra_is_a_config_error(field, module, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError, installed or not
    with pytest.raises(ConfigError) as err:
        load_config(overrides={f"logger.{field}": "true"})
    message = str(err.value)
    assert message.startswith(f"logger.{field}: ") and "pip install 'meshtron[track]'" in message
    built = []
    monkeypatch.setattr(Trainer, "__init__", lambda self, *a, **k: built.append(1))
    assert main(["train", f"--logger.{field}", "true"]) == 2
    err_text = capsys.readouterr().err
    assert err_text.count("\n") == 1 and err_text.startswith(f"error: logger.{field}: ") and not built
