"""Multi-step arithmetic: evaluate an expression of several operations with the usual precedence.

Prompt `"12+7*3-5="`, answer `"28"`. The reward is 1.0 when the completion's answer (the last
`<answer>` pair, else the last non-empty line, as for Countdown) is the integer value written as an
optional minus and decimal digits, else 0.0. Problems are generated from random integers in
[0, max_number] and operators + - *.
"""

from __future__ import annotations

import random
import re

from meshtron.rl.countdown import completion_text
from meshtron.rl.environments import GeneratedDataset, Problem


def arithmetic_reward(answer: int, completion: str) -> float:
    text = completion_text(completion)
    return 1.0 if re.fullmatch(r"-?[0-9]+", text) and int(text) == answer else 0.0


class Arithmetic:
    name = "arithmetic"

    def __init__(self, num_operations: int = 2, max_number: int = 20, eval_percent: float = 10.0):
        if num_operations < 1 or max_number < 1:
            raise ValueError("arithmetic needs num_operations >= 1 and max_number >= 1")
        self.num_operations, self.max_number, self.eval_percent = num_operations, max_number, eval_percent

    def make(self, rng: random.Random) -> tuple[str, Problem]:
        parts = [str(rng.randint(0, self.max_number))]
        for _ in range(self.num_operations):
            parts += [rng.choice("+-*"), str(rng.randint(0, self.max_number))]
        expression = "".join(parts)
        value = eval(expression, {"__builtins__": {}})  # digits and + - * only, built just above
        return expression, Problem(self.name, (expression, value), solution=str(value))

    def get_dataset(self, split: str, size: int, seed: int) -> GeneratedDataset:
        return GeneratedDataset(self.make, split, size, seed, self.eval_percent)

    def get_prompt(self, problem: Problem) -> str:
        return problem.data[0] + "="

    def get_reward(self, problem: Problem, completion: str) -> float:
        return arithmetic_reward(problem.data[1], completion)
