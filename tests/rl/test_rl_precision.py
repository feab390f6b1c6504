"""RL precision: train.precision auto resolves per device (fp32 on a CPU, runs unchanged); bf16
autocasts the training forwards (warm-up and GRPO updates) while weights and gradients stay fp32."""

from __future__ import annotations

import pytest
import torch

from tests.rl.test_grpo import rl_config


def linear_output_dtypes(model) -> list[torch.dtype]:
    """Records the output dtype of the model's first linear layer at every forward."""
    seen = []
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    return seen


class _Logger:
    def __init__(self):
        self.records = []

    def log(self, step, metrics, kind="train"):
        self.records.append(metrics)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_warmup_forward_runs_in_the_precision(tmp_path, precision, dtype):
    """The warm-up step (the trainer's accumulate/step with the supervised objective) autocasts."""
    from meshtron.rl.trainer import GRPOTrainer

    trainer = GRPOTrainer(rl_config(tmp_path, **{"train.train_iters": 1, "train.device": "cpu",
                                                 "train.precision": precision, "rl.warmup_steps": 1,
                                                 "rl.warmup_batch_size": 4}))
    seen = linear_output_dtypes(trainer.model)
    logger = _Logger()
    trainer.warmup(logger)
    assert seen and set(seen) == {dtype}
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())   # master weights stay fp32
    assert torch.isfinite(torch.tensor(logger.records[-1]["loss"]))


def test_the_grpo_trainer_resolves_auto_to_fp32_on_a_cpu(tmp_path):
    from meshtron.rl.trainer import GRPOTrainer

    trainer = GRPOTrainer(rl_config(tmp_path, **{"train.train_iters": 1, "train.device": "cpu"}))
    assert trainer.cfg.train.precision == "fp32"
