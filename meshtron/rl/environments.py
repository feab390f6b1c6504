"""Environments: where problems, prompts and verifiable rewards come from.

An environment is any object with `name`, `get_dataset(split, size, seed)`, `get_prompt(problem)`
and `get_reward(problem, completion)` (the `Environment` protocol); a generated environment also
writes a demonstration into each problem (`Problem.solution`) for the supervised warm-up.
`WeightedMultiTask` mixes several environments by weight and routes each reward to the environment
its problem came from. `build_environment` makes one from the `env` config section; a user's own
environment is added to `ENVIRONMENTS` (name -> factory taking the EnvConfig).

Generated environments split problems by a hash of what defines them (numbers and target, the
expression), so no held-out ('eval') problem is ever drawn for training: problem i of a split is
generated from its own seeded random stream, skipping problems that belong to the other split.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Problem:
    """One task instance: `data` is what the reward checks against; `solution` a demonstration."""

    env: str
    data: Any
    solution: Optional[str] = None
    meta: dict = field(default_factory=dict, compare=False, hash=False)


@runtime_checkable
class Environment(Protocol):
    name: str

    def get_dataset(self, split: str, size: int, seed: int) -> Sequence[Problem]: ...

    def get_prompt(self, problem: Problem) -> str: ...

    def get_reward(self, problem: Problem, completion: str) -> float: ...


def split_of(key: str, eval_percent: float) -> str:
    """'eval' for a stable `eval_percent` % of keys, else 'train'."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return "eval" if (h % 10_000) < eval_percent * 100 else "train"


class GeneratedDataset(Sequence):
    """Problem i of a split, generated on demand from random.Random((seed, split, i)); deterministic,
    free to index anywhere, and never containing a problem of the other split."""

    def __init__(self, make: Callable[[random.Random], tuple[str, Problem]], split: str, size: int, seed: int,
                 eval_percent: float):
        if split not in SPLITS:
            raise ValueError(f"split {split!r}: choose one of {SPLITS}")
        self.make, self.split, self.size, self.seed, self.eval_percent = make, split, size, seed, eval_percent

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        if not -self.size <= i < self.size:
            raise IndexError(f"problem {i} of {self.size}")
        rng = random.Random(f"{self.seed}/{self.split}/{i % self.size}")
        for _ in range(100_000):
            key, problem = self.make(rng)
            if split_of(key, self.eval_percent) == self.split:
                return problem
        raise RuntimeError(f"no {self.split} problem found: lower or raise env.eval_percent")


class WeightedMultiTask:
    """Several environments mixed by weight: problem i of the mixed dataset comes from environment k
    with probability weight_k (a seeded draw per index); rewards go back to the problem's own."""

    name = "multi"

    def __init__(self, environments: Sequence[Environment], weights: Sequence[float]):
        if len(environments) != len(weights) or not environments:
            raise ValueError("give one weight per environment")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError("weights must be non-negative with a positive sum")
        self.environments = {e.name: e for e in environments}
        if len(self.environments) != len(environments):
            raise ValueError("environment names must differ")
        total = sum(weights)
        self.weights = [w / total for w in weights]

    def get_dataset(self, split: str, size: int, seed: int) -> Sequence[Problem]:
        parts = {name: env.get_dataset(split, size, seed) for name, env in self.environments.items()}
        names = list(self.environments)
        weights = self.weights

        class Mixed(Sequence):
            def __len__(self) -> int:
                return size

            def __getitem__(self, i):  # type: ignore[override]
                if isinstance(i, slice):
                    return [self[j] for j in range(*i.indices(size))]
                name = random.Random(f"{seed}/{split}/mix/{i}").choices(names, weights)[0]
                return parts[name][i]

        return Mixed()

    def get_prompt(self, problem: Problem) -> str:
        return self.environments[problem.env].get_prompt(problem)

    def get_reward(self, problem: Problem, completion: str) -> float:
        return self.environments[problem.env].get_reward(problem, completion)


def _countdown(cfg) -> Environment:
    from meshtron.rl.countdown import Countdown

    return Countdown(cfg.countdown_num_numbers, cfg.countdown_max_number, cfg.countdown_max_target,
                     cfg.countdown_operators, cfg.format_reward, cfg.eval_percent)


def _arithmetic(cfg) -> Environment:
    from meshtron.rl.arithmetic import Arithmetic

    return Arithmetic(cfg.arithmetic_num_operations, cfg.arithmetic_max_number, cfg.eval_percent)


def _math(cfg) -> Environment:
    from meshtron.rl.math_env import MathEnvironment

    return MathEnvironment(cfg.math_path, cfg.eval_percent)


ENVIRONMENTS: dict[str, Callable[[Any], Environment]] = {"countdown": _countdown, "arithmetic": _arithmetic,
                                                          "math": _math}


def build_environment(cfg) -> Environment:
    """The environment(s) named by `env.names` with `env.weights` (one name: that environment alone)."""
    from meshtron.config.fields import check

    names = list(cfg.names)
    unknown = [n for n in names if n not in ENVIRONMENTS]
    check(not unknown, "env.names", names, f"unknown environment(s) {unknown}; choose from {sorted(ENVIRONMENTS)}")
    envs = [ENVIRONMENTS[n](cfg) for n in names]
    if len(envs) == 1:
        return envs[0]
    weights = list(cfg.weights) or [1.0] * len(envs)
    return WeightedMultiTask(envs, weights)
