"""train.precision auto: bf16 on CUDA, fp32 on a CPU (CPU runs unchanged); TF32 matmuls only on CUDA;
bad values are one line naming the field."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import load_config
from meshtron.config.fields import ConfigError
from meshtron.training import Trainer
from meshtron.training.precision import enable_tf32, resolve_precision


def test_auto_resolves_by_device():
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda")) == "bf16"   # a device object: no GPU needed
    assert resolve_precision("fp32", torch.device("cuda")) == "fp32"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    with pytest.raises(ValueError, match="train.precision"):
        resolve_precision("fp16", torch.device("cpu"))


def test_tf32_only_on_cuda():
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert enable_tf32(torch.device("cpu")) is False
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert enable_tf32(torch.device("cuda")) is True
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def test_the_default_is_auto_and_a_bad_value_is_one_line():
    assert load_config().train.precision == "auto"
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"train.precision": "fp16"})
    message = str(err.value)
    assert "train.precision" in message and "auto" in message and "\n" not in message


def test_a_cpu_run_resolves_auto_to_fp32(tiny_config):
    """The default on a CPU computes in fp32 exactly as precision fp32 does (same losses, bitwise)."""
    common = {"train.train_iters": "2", "scheduler.decay_steps": "2", "checkpoint.save_at_end": "false",
              "train.device": "cpu"}
    auto = Trainer(tiny_config(**common))
    assert auto.cfg.train.precision == "fp32"
    fp32 = Trainer(tiny_config(**common, **{"train.precision": "fp32"}))
    assert [r.loss for r in auto.train()] == [r.loss for r in fp32.train()]
