"""A tiny model for RL tests and a trivially learnable environment (reward: the share of digits in
the completion), registered under the name 'digits'."""

from __future__ import annotations

import random

import torch

from meshtron.config import ModelConfig
from meshtron.data.tokenizer import ByteTokenizer
from meshtron.models import GPTModel
from meshtron.rl.environments import ENVIRONMENTS, GeneratedDataset, Problem

TOKENIZER = ByteTokenizer()


def tiny_model(seed: int = 0, std: float = 0.2) -> GPTModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                      max_position_embeddings=64, make_vocab_size_divisible_by=1, init_method_std=std)
    return GPTModel(cfg, TOKENIZER.vocab_size).eval()


class Digits:
    """Prompt: a lowercase letter. Reward: the fraction of the completion's characters that are digits."""

    name = "digits"

    def make(self, rng: random.Random):
        letter = rng.choice("abcdefghijklmnopqrstuvwxyz")
        return letter + str(rng.random()), Problem(self.name, letter, solution="123")

    def get_dataset(self, split, size, seed):
        return GeneratedDataset(self.make, split, size, seed, eval_percent=10.0)

    def get_prompt(self, problem):
        return problem.data

    def get_reward(self, problem, completion):
        return sum(c.isdigit() for c in completion) / max(len(completion), 1)


ENVIRONMENTS.setdefault("digits", lambda cfg: Digits())


def grpo_history(rank: int, world_size: int, overrides: dict[str, str]) -> list[dict]:
    """Run GRPO with these config overrides (a rank of run_ranks, or world_size 1 in-process)."""
    from meshtron.config import load_config
    from meshtron.rl.trainer import GRPOTrainer

    return GRPOTrainer(load_config(overrides=overrides, world_size=world_size)).train()


def grpo_step_gradients(rank: int, world_size: int, overrides: dict[str, str], steps: int = 1):
    """Run `steps` GRPO steps; return each step's metrics and the full (unsharded) gradients the
    optimizer saw on its first step (under pp: of this rank's stages)."""
    from torch.distributed.tensor import DTensor

    from meshtron.config import load_config
    from meshtron.rl.trainer import GRPOTrainer

    trainer = GRPOTrainer(load_config(overrides=overrides, world_size=world_size))
    grads: dict[str, torch.Tensor] = {}

    def capture(optimizer, args, kwargs):
        if not grads:
            for name, p in trainer.train_model.named_parameters():  # under pp: this rank's stages
                g = p.grad
                grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()

    trainer.optimizer.register_step_pre_hook(capture)
    if trainer.cfg.rl.kl_beta > 0:  # as train() does before the first step
        trainer.ref_model = trainer._frozen_copy()
    history = [trainer.grpo_step() for _ in range(steps)]
    return history, grads


def resumed_histories(common: dict[str, str], world_size: int, tmp_path, timeout_s: float = 300):
    """(the uninterrupted run's history, the history of a run saved after step 2 and resumed); both
    under `world_size` ranks with `common` overrides (train.train_iters 4)."""
    from meshtron.testing.multiprocess import run_ranks

    def run(**extra):
        return run_ranks("tests.rl.helpers:grpo_history", world_size, timeout_s=timeout_s,
                         overrides={**common, **extra})[0]

    full = run(**{"train.run_dir": str(tmp_path / "a")})
    run(**{"train.train_iters": "2", "checkpoint.save_at_end": "true", "train.run_dir": str(tmp_path / "b")})
    tail = run(**{"checkpoint.load": str(tmp_path / "b" / "checkpoints"), "train.run_dir": str(tmp_path / "b")})
    return full, tail


def grpo_layout_run(rank: int, world_size: int, overrides: dict[str, str]):
    """One GRPO step under a layout; -> (its metrics, the full gradients the optimizer saw, the full
    weights after the step, the largest |engine - trainer| log prob over the completion tokens of a
    second batch of rollouts sampled from the updated policy, whether the policy is sharded)."""
    from torch.distributed.tensor import DTensor

    from meshtron.config import load_config
    from meshtron.rl.grpo import train_sequences
    from meshtron.rl.trainer import GRPOTrainer

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    trainer = GRPOTrainer(load_config(overrides=overrides, world_size=world_size))
    grads: dict[str, torch.Tensor] = {}

    def capture(optimizer, args, kwargs):
        if not grads:
            grads.update({name: full(p.grad) for name, p in trainer.train_model.named_parameters()})

    trainer.optimizer.register_step_pre_hook(capture)
    if trainer.cfg.rl.kl_beta > 0:
        trainer.ref_model = trainer._frozen_copy()
    history = [trainer.grpo_step()]
    weights = {name: full(p) for name, p in trainer.train_model.named_parameters()}
    # the engine samples from the rollout model synced from the updated (sharded) policy
    rl = trainer.cfg.rl
    share = rl.prompts_per_step // (trainer.dims.dp * trainer.num_shares)
    first = trainer.dp_rank * share * trainer.num_shares + trainer.share_rank * share
    trainer._sync()
    rollouts = trainer.rollouts.generate(trainer.backend, trainer.env, trainer.tokenizer,
                                         [trainer.train_problems[first + i] for i in range(share)], trainer.sampling(),
                                         trainer.cfg.train.seed, 99, first_group=first)
    if trainer.share_axes:
        from meshtron.rl.policy import gather_objects

        rollouts = gather_objects(rollouts, [trainer.mesh[a].get_group() for a in trainer.share_axes])
    for r in rollouts:
        r.advantage = 0.0
    batch, real = trainer._policy_batches(train_sequences(rollouts, rl.aggregation, rl.max_new_tokens,
                                                          trainer.group("dp")))
    trainer.model.train()
    trainer._log_probs(trainer.model if trainer.pipeline is None else trainer.pipeline.parts, batch, "trainer")
    gap = 0.0
    for mb in batch[:real]:
        if "trainer" in mb:  # under pp: on the last stage
            mask = mb["weights"] > 0
            gap = max(gap, float((mb["trainer"] - mb["rollout_log_probs"])[mask].abs().max()))
    sharded = any(isinstance(p, DTensor) for p in trainer.train_model.parameters())
    return history, grads, weights, gap, sharded
