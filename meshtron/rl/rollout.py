"""Grouped rollouts and the evaluation agent, each a Protocol with a shipped implementation.

`RolloutGenerator` (shipped: `GroupedRollouts`, i.e. `generate_groups`) samples `group_size` completions of every prompt through an inference backend and
scores each with the environment's reward; each completion has its own sampling seed derived from
(seed, step, prompt, sample), so a run (and a resumed run) draws the same rollouts.
`EvaluationAgent` (shipped: `PassAtKEvaluator`, i.e. `evaluate`) reports, on held-out problems, the greedy success rate (temperature 0, one sample) and
pass@k from n samples at a temperature, with the unbiased estimator 1 - C(n-c, k) / C(n, k).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

from meshtron.inference.request import SamplingParams
from meshtron.rl.environments import Environment, Problem
from meshtron.rl.inference import InferenceBackend


@dataclass
class Rollout:
    problem: Problem
    group: int  # the prompt's index in the prompt stream (global over ranks)
    sample: int  # which of the group's samples
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    text: str
    reward: float
    advantage: float = 0.0
    routing: Optional[dict] = None  # MoE: router name -> (positions, k) experts the engine chose


def sample_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """A distinct, reproducible 63-bit seed per completion."""
    x = (seed * 1_000_003 + step) * 1_000_033 + prompt
    return (x * 1_000_037 + sample) % (2**63 - 1)


def generate_groups(backend: InferenceBackend, env: Environment, tokenizer, problems: Sequence[Problem],
                    group_size: int, sampling: SamplingParams, seed: int, step: int,
                    first_group: int = 0) -> list[Rollout]:
    """group_size rollouts per problem, groups consecutive, each scored by the environment."""
    prompt_ids = [tokenizer.encode(env.get_prompt(p)) for p in problems]
    prompts, params = [], []
    for i, ids in enumerate(prompt_ids):
        for j in range(group_size):
            prompts.append(ids)
            params.append(SamplingParams(**{**vars(sampling), "seed": sample_seed(seed, step, first_group + i, j)}))
    generations = backend.generate(prompts, params)
    rollouts = []
    for k, gen in enumerate(generations):
        i = k // group_size
        rollouts.append(Rollout(problems[i], first_group + i, k % group_size, prompt_ids[i], gen.token_ids, gen.log_probs,
                                gen.text, float(env.get_reward(problems[i], gen.text)), routing=gen.routing))
    return rollouts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c of them correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(backend: InferenceBackend, env: Environment, tokenizer, problems: Sequence[Problem], max_tokens: int,
             num_samples: int = 0, k: int = 1, temperature: float = 1.0, seed: int = 0,
             stop_token_ids: tuple[int, ...] = ()) -> dict[str, float]:
    """{'greedy_success', 'pass@k' (when num_samples >= k > 0), 'mean_reward' (of the greedy answers)}."""
    prompts = [tokenizer.encode(env.get_prompt(p)) for p in problems]
    greedy = backend.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      stop_token_ids=stop_token_ids))
    rewards = [env.get_reward(p, g.text) for p, g in zip(problems, greedy)]
    out = {"greedy_success": sum(r >= 1.0 for r in rewards) / len(problems),
           "mean_reward": sum(rewards) / len(problems)}
    if num_samples and k:
        groups = generate_groups(backend, env, tokenizer, problems, num_samples,
                                 SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                stop_token_ids=stop_token_ids), seed, step=-1)
        correct = [sum(r.reward >= 1.0 for r in groups[i * num_samples:(i + 1) * num_samples])
                   for i in range(len(problems))]
        out[f"pass@{k}"] = sum(pass_at_k(num_samples, c, k) for c in correct) / len(problems)
    return out


@runtime_checkable
class RolloutGenerator(Protocol):
    """Makes the rollouts of one GRPO step: exactly `group_size` per problem, groups consecutive and in
    problem order, each with its prompt/completion ids, the backend's log probs and its reward."""

    group_size: int

    def generate(self, backend: InferenceBackend, env: Environment, tokenizer, problems: Sequence[Problem],
                 sampling: SamplingParams, seed: int, step: int, first_group: int = 0) -> list[Rollout]: ...


@runtime_checkable
class EvaluationAgent(Protocol):
    """Scores the policy on held-out problems; returns named numbers (the trainer averages each over
    ranks weighted by the problems a rank evaluated, so every rank must return the same keys)."""

    def evaluate(self, backend: InferenceBackend, env: Environment, tokenizer,
                 problems: Sequence[Problem]) -> dict[str, float]: ...


@dataclass
class GroupedRollouts:
    """The shipped rollout generator: `generate_groups`."""

    group_size: int

    def generate(self, backend: InferenceBackend, env: Environment, tokenizer, problems: Sequence[Problem],
                 sampling: SamplingParams, seed: int, step: int, first_group: int = 0) -> list[Rollout]:
        return generate_groups(backend, env, tokenizer, problems, self.group_size, sampling, seed, step, first_group)


@dataclass
class PassAtKEvaluator:
    """The shipped evaluation agent: `evaluate` (greedy success, mean reward, pass@k)."""

    max_tokens: int
    num_samples: int = 0
    k: int = 1
    temperature: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def evaluate(self, backend: InferenceBackend, env: Environment, tokenizer,
                 problems: Sequence[Problem]) -> dict[str, float]:
        return evaluate(backend, env, tokenizer, problems, self.max_tokens, self.num_samples, self.k,
                        self.temperature, self.seed, self.stop_token_ids)


def completion_lengths(rollouts: Sequence[Rollout]) -> list[int]:
    return [len(r.completion_ids) for r in rollouts]

