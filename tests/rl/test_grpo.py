"""The GRPO loop: a short run raises the mean reward of a trivially learnable environment (fixed
seed); an interrupted and resumed run reproduces the uninterrupted one; the warm-up learns the
demonstrations; packing puts weights, advantages and rollout log probs on the right tokens; the
`meshtron rl` command runs and refuses bad settings in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tests.rl.helpers  # noqa: F401  (registers the 'digits' environment)
from meshtron.cli import main
from meshtron.config import ConfigError, load_config
from meshtron.rl.packing import TrainSequence, pack_sequences

TINY_RL = {
    "model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
    "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64", "model.make_vocab_size_divisible_by": "1",
    "data.seq_length": "32", "tokenizer.type": "byte", "train.micro_batch_size": "4", "train.global_batch_size": "4",
    "train.seed": "7", "optimizer.lr": "1e-2", "optimizer.weight_decay": "0", "scheduler.warmup_steps": "0",
    "scheduler.decay_style": "constant", "logger.progress_bar": "off", "logger.log_interval": "1",
    "env.names": "[digits]", "rl.prompts_per_step": "8", "rl.group_size": "8", "rl.max_new_tokens": "4",
    "rl.pack_length": "64", "rl.eval_problems": "8", "rl.eval_samples": "0", "rl.eval_interval": "0",
    "rl.engine_kv_cache_memory_mb": "4", "checkpoint.save_at_end": "false",
}


def rl_config(tmp_path, **overrides):
    return load_config(overrides={**TINY_RL, "train.run_dir": str(tmp_path / "run"),
                                  **{k: str(v) for k, v in overrides.items()}})


def test_short_run_raises_the_mean_reward(tmp_path):
    from meshtron.rl.trainer import GRPOTrainer

    history = GRPOTrainer(rl_config(tmp_path, **{"train.train_iters": 20})).train()
    rewards = [h["reward_mean"] for h in history]
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.2 and last > 3 * first, rewards
    assert history[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # one update per batch: on policy
    assert history[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and history[0]["logprob_gap"] < 1e-5
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {x["kind"] for x in lines} == {"train", "eval"} and sum(x["kind"] == "train" for x in lines) == 20
    curve = (tmp_path / "run" / "reward_curve.csv").read_text().splitlines()
    assert curve[0].startswith("step,reward_mean") and len(curve) == 1 + 1 + 20 + 1  # header, eval 0, steps, final


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    from meshtron.rl.trainer import GRPOTrainer

    common = {"train.train_iters": 4, "rl.updates_per_step": 2, "rl.kl_beta": 0.05}
    full = GRPOTrainer(rl_config(tmp_path / "a", **common)).train()
    first = GRPOTrainer(rl_config(tmp_path / "b", **{**common, "train.train_iters": 2, "checkpoint.save_at_end": True}))
    first.train()
    resumed = GRPOTrainer(rl_config(tmp_path / "b", **{**common, "checkpoint.load": str(tmp_path / "b/run/checkpoints")}))
    assert resumed.step == 2 and resumed.consumed_prompts == 16 and resumed.ref_model is not None
    tail = resumed.train()
    for a, b in zip(full[2:], tail):
        assert a["step"] == b["step"]
        for key in ("reward_mean", "loss", "kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert full[-1]["kl"] > 0 and 0 < full[-1]["ratio_mean"]


def test_warmup_learns_the_demonstrations(tmp_path):
    from meshtron.rl.trainer import GRPOTrainer

    cfg = rl_config(tmp_path, **{"train.train_iters": 1, "rl.warmup_steps": 30, "rl.warmup_batch_size": 16,
                                 "rl.warmup_lr": 1e-2})
    GRPOTrainer(cfg).train()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warm = [x for x in lines if x["kind"] == "warmup"]
    assert len(warm) == 30 and warm[-1]["loss"] < 0.3 * warm[0]["loss"]  # the demonstration is always '123'
    evaluation = next(x for x in lines if x["kind"] == "eval")
    assert evaluation["mean_reward"] > 0.5  # greedy answers are mostly digits now


def test_packing_places_weights_advantages_and_log_probs():
    seqs = [TrainSequence([1, 2, 3, 4, 5], 2, 0.5, advantage=1.5, rollout_log_probs=[-0.1, -0.2, -0.3]),
            TrainSequence([7, 8, 9], 1, 0.25, advantage=-1.0, rollout_log_probs=[-0.4, -0.5]),
            TrainSequence([6, 6, 6, 6, 6, 6, 6], 3, 1.0, advantage=2.0, rollout_log_probs=[-1.0] * 4)]
    rows = pack_sequences(seqs, 8, pad_id=0)
    # best fit decreasing over 4, 2 and 6 positions: 6 opens row A, 4 opens row B, 2 fills row A
    assert len(rows) == 2
    a, b = (rows[0], rows[1]) if rows[0]["input_ids"][0] == 7 else (rows[1], rows[0])
    assert a["input_ids"].tolist() == [7, 8, 6, 6, 6, 6, 6, 6]
    assert a["labels"].tolist() == [8, 9, 6, 6, 6, 6, 6, 6]
    assert a["document_ids"].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert a["position_ids"].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]
    # a label is trained from the first completion token on: sequence 1 from its token 1, sequence 2 from token 3
    assert a["weights"].tolist() == [0.25, 0.25, 0, 0, 1, 1, 1, 1]
    assert a["advantages"].tolist() == [-1, -1, 0, 0, 2, 2, 2, 2]
    assert np.allclose(a["rollout_log_probs"], [-0.4, -0.5, 0, 0, -1, -1, -1, -1])
    assert b["input_ids"].tolist() == [1, 2, 3, 4, 0, 0, 0, 0] and b["labels"].tolist()[:4] == [2, 3, 4, 5]
    assert b["document_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # padding is a document of its own
    assert b["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert b["weights"].tolist() == [0, 0.5, 0.5, 0.5, 0, 0, 0, 0]
    assert b["advantages"].tolist() == [0, 1.5, 1.5, 1.5, 0, 0, 0, 0]
    assert np.allclose(b["rollout_log_probs"], [0, -0.1, -0.2, -0.3, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="rl.pack_length"):
        pack_sequences(seqs, 4, pad_id=0)


def test_rl_command_and_config_errors(tmp_path, capsys):
    overrides = [f"--{k}={v}" for k, v in {**TINY_RL, "train.train_iters": "1", "train.run_dir": str(tmp_path / "r"),
                                            "rl.prompts_per_step": "2", "rl.group_size": "2"}.items()]
    assert main(["rl", *overrides]) == 0
    assert (tmp_path / "r" / "reward_curve.csv").is_file()
    assert main(["rl", *overrides, "--rl.group_size=1"]) == 2
    assert "rl.group_size: 1 is not allowed; must be >= 2" in capsys.readouterr().err
    assert main(["rl", *overrides, "--parallel.ep=2", f"--train.run_dir={tmp_path / 'ep'}"]) == 2
    # expert parallelism is a layout of the trainer now: refused here only because one process has no ranks to borrow
    assert "parallel.ep: 2 must divide dp_shard*cp = 1" in capsys.readouterr().err
    from meshtron.rl.environments import build_environment

    with pytest.raises(ConfigError, match="env.names"):
        build_environment(rl_config(tmp_path, **{"env.names": "[chess]"}).env)


@pytest.mark.slow
def test_data_parallel_ranks_reproduce_the_single_process_run(tmp_path):
    """Two gloo ranks, each generating half the prompts with its own engine: rollout seeds depend on
    the prompt's global index and the loss carries global normalisers, so rewards, losses and
    gradient norms equal the single-process run's."""
    from meshtron.testing.multiprocess import run_ranks
    from tests.rl.helpers import grpo_history

    overrides = {**TINY_RL, "train.train_iters": "3", "rl.updates_per_step": "2", "rl.kl_beta": "0.05",
                 "rl.aggregation": "token_mean"}
    single = grpo_history(0, 1, {**overrides, "train.run_dir": str(tmp_path / "single")})
    ranks = run_ranks("tests.rl.helpers:grpo_history", 2, timeout_s=240,
                      overrides={**overrides, "train.run_dir": str(tmp_path / "dp")})
    for a, b, c in zip(single, ranks[0], ranks[1]):
        for key in ("reward_mean", "loss", "kl", "grad_norm", "train_tokens", "entropy"):
            assert b[key] == c[key], key  # every rank reports the global numbers
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_a_non_finite_step_is_skipped_by_the_trainer(tmp_path):
    """GRPO steps are the trainer's: an injected NaN loss skips the optimizer step (weights unchanged,
    counted in skipped_steps), and the next step trains."""
    import torch

    from meshtron.rl.trainer import GRPOTrainer

    trainer = GRPOTrainer(rl_config(tmp_path, **{"train.train_iters": 2, "train.debug_nonfinite_steps": "[1]"}))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    first = trainer.grpo_step()
    assert first["skipped_steps"] == 1 and trainer.num_skipped == 1 and trainer.nonfinite_in_a_row == 1
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    second = trainer.grpo_step()
    assert second["skipped_steps"] == 0 and trainer.nonfinite_in_a_row == 0
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
