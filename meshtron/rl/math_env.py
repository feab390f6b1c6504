"""Math answers checked by `math-verify` (the optional extra 'math'): the completion's final answer
is parsed (LaTeX, fractions, boxed answers, plain numbers) and compared symbolically with the gold
answer, so `\\frac{11}{12}`, `11/12` and `\\boxed{11/12}` all count.

Problems come from a JSONL file (`env.math_path`, one `{"problem": ..., "answer": ...}` per line,
split into train/eval by a hash of the problem) or, without a file, are generated: sums and
differences of two fractions, with the reduced result as a LaTeX fraction.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Optional

from meshtron.rl.environments import GeneratedDataset, Problem, split_of


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError("the math environment needs the 'math' extra: pip install 'meshtron[math]'") from None
    return math_verify


def latex(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


class MathEnvironment:
    name = "math"

    def __init__(self, path: Optional[str] = None, eval_percent: float = 10.0):
        self.mv = _math_verify()
        self.path, self.eval_percent = path, eval_percent
        self.rows: Optional[list[dict]] = None
        if path is not None:
            p = Path(path)
            if not p.is_file():
                from meshtron.config.fields import ConfigError

                raise ConfigError(f"env.math_path: file {path!r} not found; give a JSONL file of "
                                  "{\"problem\": ..., \"answer\": ...} lines")
            self.rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

    def make(self, rng: random.Random) -> tuple[str, Problem]:
        a = Fraction(rng.randint(1, 9), rng.randint(2, 9))
        b = Fraction(rng.randint(1, 9), rng.randint(2, 9))
        op = rng.choice("+-")
        value = a + b if op == "+" else a - b
        text = f"{a.numerator}/{a.denominator} {op} {b.numerator}/{b.denominator}"
        return text, Problem(self.name, (f"Compute {text}.", latex(value)), solution=latex(value))

    def get_dataset(self, split: str, size: int, seed: int) -> Sequence[Problem]:
        if self.rows is None:
            return GeneratedDataset(self.make, split, size, seed, self.eval_percent)
        mine = [Problem(self.name, (r["problem"], str(r["answer"])), solution=str(r["answer"]))
                for r in self.rows if split_of(r["problem"], self.eval_percent) == split]
        if not mine:
            raise ValueError(f"env.math_path: no {split} problems in {self.path}; add problems or change "
                             "env.eval_percent")
        order = random.Random(f"{seed}/{split}").sample(range(len(mine)), len(mine))
        return [mine[order[i % len(mine)]] for i in range(size)]

    def get_prompt(self, problem: Problem) -> str:
        return problem.data[0] + "\nAnswer: "

    def get_reward(self, problem: Problem, completion: str) -> float:
        gold = self.mv.parse(f"${problem.data[1]}$")
        answer = self.mv.parse(completion.split("\n", 1)[0].strip())
        return 1.0 if answer and self.mv.verify(gold, answer) else 0.0
