"""RL precision: train.precision auto resolves per device (fp32 on a CPU, runs unchanged); bf16
autocasts the training forwards (warm-up and GRPO updates) while weights and gradients stay fp32."""

from __future__ import annotations

import pytest
import torch

from meshtron.rl.grpo import supervised_step
from meshtron.rl.packing import TrainSequence
from tests.rl.helpers import TOKENIZER, tiny_model
from tests.rl.test_grpo import rl_config


def linear_output_dtypes(model) -> list[torch.dtype]:
    """Records the output dtype of the model's first linear layer at every forward."""
    seen = []
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_supervised_step_forward_runs_in_the_precision(precision, dtype):
    model = tiny_model()
    seen = linear_output_dtypes(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seqs = [TrainSequence([1, 2, 3, 4, 5, 6], 2, 0.25), TrainSequence([7, 8, 9, 10], 1, 0.25)]
    metrics = supervised_step(model, optimizer, seqs, 16, TOKENIZER.pad_id, 2, torch.device("cpu"), 0.0, 0.0,
                              precision=precision)
    assert seen and set(seen) == {dtype}
    assert all(p.dtype == torch.float32 for p in model.parameters())   # master weights stay fp32
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_the_grpo_trainer_resolves_auto_to_fp32_on_a_cpu(tmp_path):
    from meshtron.rl.trainer import GRPOTrainer

    trainer = GRPOTrainer(rl_config(tmp_path, **{"train.train_iters": 1, "train.device": "cpu"}))
    assert trainer.cfg.train.precision == "fp32"
