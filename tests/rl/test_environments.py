"""Environments (the Countdown reward itself: test_countdown.py): generated problems whose
demonstrations earn full reward, disjoint train/eval splits, arithmetic and math-verify rewards, and
weighted mixing of environments."""

from __future__ import annotations

from collections import Counter

import pytest

from meshtron.rl.arithmetic import Arithmetic, arithmetic_reward
from meshtron.rl.countdown import Countdown
from meshtron.rl.environments import Environment, Problem, WeightedMultiTask


def test_countdown_problems_demonstrations_and_splits():
    env = Countdown(num_numbers=3, max_number=9, max_target=50, operators="+-*")
    assert isinstance(env, Environment)
    train, held_out = env.get_dataset("train", 400, seed=1), env.get_dataset("eval", 100, seed=1)
    for p in list(train[:100]) + list(held_out[:100]):
        numbers, target = p.data
        assert 0 < target <= 50 and len(numbers) == 3
        assert env.get_reward(p, p.solution) == 1.0  # the demonstration is a correct answer
        assert env.get_prompt(p) == f"{numbers[0]} {numbers[1]} {numbers[2]} -> {target}: "
    key = lambda p: (tuple(sorted(p.data[0])), p.data[1])  # noqa: E731
    assert not {key(p) for p in train} & {key(p) for p in held_out}
    assert [p.data for p in env.get_dataset("train", 5, seed=1)] == [p.data for p in train[:5]]  # deterministic
    assert [p.data for p in env.get_dataset("train", 5, seed=2)] != [p.data for p in train[:5]]


def test_arithmetic():
    env = Arithmetic(num_operations=2, max_number=20)
    p = env.get_dataset("train", 10, seed=0)[3]
    expression, value = p.data
    assert env.get_prompt(p) == expression + "=" and eval(expression) == value
    assert env.get_reward(p, f"{value}\n") == 1.0 and env.get_reward(p, str(value + 1)) == 0.0
    assert arithmetic_reward(28, " 28 ") == 1.0 and arithmetic_reward(28, "twenty") == 0.0


def test_math_verify_environment(tmp_path):
    pytest.importorskip("math_verify")
    from meshtron.rl.math_env import MathEnvironment

    env = MathEnvironment()
    p = Problem("math", ("Compute 1/2 + 1/3.", "\\frac{5}{6}"))
    for answer, reward in (("5/6", 1.0), ("\\frac{5}{6}", 1.0), ("$\\boxed{\\frac{10}{12}}$", 1.0),
                           ("6/5", 0.0), ("five sixths", 0.0), ("", 0.0)):
        assert env.get_reward(p, answer) == reward, answer
    generated = env.get_dataset("train", 3, seed=0)[0]
    assert env.get_reward(generated, generated.solution) == 1.0
    path = tmp_path / "math.jsonl"
    path.write_text("".join(f'{{"problem": "What is {i}+{i}?", "answer": "{2 * i}"}}\n' for i in range(40)))
    env = MathEnvironment(str(path))
    train, held_out = env.get_dataset("train", 50, seed=0), env.get_dataset("eval", 5, seed=0)
    assert not {p.data for p in train} & {p.data for p in held_out}
    assert all(env.get_reward(p, p.data[1]) == 1.0 for p in train[:5])


def test_weighted_multi_task_mixes_and_routes_rewards():
    mix = WeightedMultiTask([Countdown(), Arithmetic()], [3.0, 1.0])
    problems = mix.get_dataset("train", 2000, seed=0)
    counts = Counter(p.env for p in problems)
    assert abs(counts["countdown"] / 2000 - 0.75) < 0.04
    for p in problems[:20]:
        assert mix.get_reward(p, p.solution) == 1.0
        assert mix.get_prompt(p).endswith(": " if p.env == "countdown" else "=")
    with pytest.raises(ValueError, match="one weight per environment"):
        WeightedMultiTask([Countdown()], [1.0, 2.0])
