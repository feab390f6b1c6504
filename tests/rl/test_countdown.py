"""The Countdown reward: hand-checked cases, the parser's values against Python's own fraction
arithmetic, bounded work on pathological input, and agreement with reasoning-gym's scorer
(`reasoning_gym.games.countdown`, the independent reference) on problems it generates."""

from __future__ import annotations

import random
import re
from fractions import Fraction

import pytest

from meshtron.rl.countdown import (
    MAX_DIGITS,
    MAX_NODES,
    Countdown,
    MalformedExpression,
    countdown_reward,
    parse_expression,
    render,
)

LONG = "(" * 70 + "3" + ")" * 70  # 141 characters, a correct answer to "3 -> 3"

CASES = [
    # numbers, target, completion, reward  (format_reward 0.1)
    ((3, 5, 7), 22, "3*5+7", 1.0),               # valid
    ((3, 5, 7), 22, "7+5*3", 1.0),               # valid, numbers in another order
    ((3, 5, 7), 22, " 3 * 5 + 7 ", 1.0),         # blanks anywhere
    ((4, 4, 2), 4, "(4+4)/2", 1.0),              # valid, a repeated number used twice, division
    ((6, 3, 2), 1, "6/3/2", 1.0),                # left-associative division: (6/3)/2
    ((3, 5, 5), 22, "-3+5*5", 1.0),              # unary minus
    ((3, 5, 7), 8, "-(3*5)+7*(+3-0)", 0.0),      # 0 is not a given number
    ((3, 5, 7), -8, "-(3*5)+7", 1.0),            # unary minus on a parenthesis
    ((3, 5, 7), 22, "\n3*5+7", 1.0),             # a leading newline: the answer is the last non-empty line
    ((3, 5, 7), 22, "3*5 is 15\n3*5+7\n\n", 1.0),  # working on earlier lines, the answer last
    ((3, 5, 7), 22, "3*5+7\nwhich is 22", 0.0),  # prose after the expression: that line is the answer
    ((3, 5, 7), 22, "think: 7*5?\n<answer> 3*5+7 </answer>\nso", 1.0),  # an <answer> pair wins over lines
    ((3, 5, 7), 22, "<answer>3*7+5</answer><answer>3*5+7</answer>", 1.0),  # the last pair is the answer
    ((3, 5, 7), 22, "<answer>3*5+7</answer><answer>7</answer>", 0.0),
    ((3,), 3, LONG, 1.0),                        # no length limit
    ((3, 5, 7), 22, "3*5+8", 0.0),               # wrong number (8 not given)
    ((3, 5, 7), 15, "3*5", 0.0),                 # a number left unused
    ((3, 5, 7), 22, "3*5+7+7", 0.0),             # a number used twice
    ((4, 4, 2), 16, "4*4", 0.0),                 # the repeated number but 2 unused
    ((3, 5, 7), 23, "3*5+7", 0.1),               # right numbers, wrong value
    ((3, 5, 7), 22, "3*(5+7)", 0.1),             # right numbers, wrong value (36)
    ((3, 5, 7), 22, "3*5+", 0.0),                # malformed
    ((3, 5, 7), 22, "3*5+7)", 0.0),              # unbalanced
    ((3, 5, 7), 22, "3 5+7", 0.0),               # two numbers in a row
    ((3, 5, 7), 22, "", 0.0),                    # empty
    ((3, 5, 7), 22, "\n \n", 0.0),               # blank lines only
    ((3, 5, 7), 22, "3**5+7", 0.0),              # Python's power is not an operator here
    ((7, 3, 20), 22, "7//3+20", 0.0),            # nor floor division
    ((10, 12), 22, "1_0+12", 0.0),               # nor digit separators
    ((31, 9), 22, "0x1f-9", 0.0),                # nor hexadecimal
    ((7, 15), 22, "07+15", 0.0),                 # nor leading zeros
    ((3, 5, 7), 22, "__import__('os')", 0.0),    # no calls or names
    ((3, 5, 7), 22, "3.0*5+7", 0.0),             # floats are not numbers of the puzzle
    ((5, 0, 3), 3, "5/0+3", 0.0),                # division by zero
    ((3, 5, 7), 22, "3*5+7" + " " * 80, 1.0),    # trailing blanks are stripped
    ((3, 5, 7), 22, "3×5+7", 0.0),               # ASCII operators only
]


@pytest.mark.parametrize("numbers,target,completion,reward", CASES)
def test_countdown_reward_table(numbers, target, completion, reward):
    assert countdown_reward(numbers, target, completion, format_reward=0.1) == reward


def test_parse_and_render_agree():
    node = ("-", 9, ("-", 5, ("*", 2, 3)))
    text = render(node)
    assert text == "9-(5-2*3)"
    value, used = parse_expression(text)
    assert value == 10 and used == [9, 5, 2, 3]
    # a*(b/c) needs no parentheses (same value); a/(b*c) does
    assert render(("*", ("+", 1, 2), ("/", 8, ("*", 2, 2)))) == "(1+2)*8/(2*2)"
    assert parse_expression("(1+2)*8/(2*2)")[0] == 6


def _random_expression(rng: random.Random, depth: int) -> str:
    blank = lambda: rng.choice(["", "", " "])  # noqa: E731
    if depth == 0 or rng.random() < 0.25:
        text = str(rng.randint(0, 99))
    else:
        op = rng.choice("+-*/")
        text = _random_expression(rng, depth - 1) + blank() + op + blank() + _random_expression(rng, depth - 1)
    if rng.random() < 0.2:
        text = rng.choice("-+") + text
    if rng.random() < 0.3:
        text = "(" + text + ")"
    return text


def test_parser_matches_python_fraction_arithmetic():
    """Python's parser and arithmetic on Fractions are the reference for what the text means."""
    rng = random.Random(0)
    checked = 0
    for _ in range(2000):
        text = _random_expression(rng, 4)
        try:
            expected = eval(re.sub(r"[0-9]+", r"Fraction(\g<0>)", text), {"Fraction": Fraction})
        except ZeroDivisionError:
            with pytest.raises(MalformedExpression, match="division by zero"):
                parse_expression(text)
            continue
        value, used = parse_expression(text)
        assert value == expected, text
        assert used == [int(n) for n in re.findall(r"[0-9]+", text)]
        checked += 1
    assert checked > 1500


def test_pathological_input_is_bounded():
    ones = "+".join(["1"] * (MAX_NODES // 2))  # 128 numbers, 127 operators: within the bound
    assert countdown_reward((1,) * (MAX_NODES // 2), MAX_NODES // 2, ones) == 1.0
    too_many = ones + "+1"
    assert countdown_reward((1,) * (MAX_NODES // 2 + 1), MAX_NODES // 2 + 1, too_many) == 0.0
    big = "9" * (MAX_DIGITS + 1)
    assert countdown_reward((int(big),), int(big), big) == 0.0
    assert countdown_reward((int(big[1:]),), int(big[1:]), big[1:]) == 1.0
    for text in ("(" * 1_000_000 + "3", "-" * 1_000_000 + "3", "3" * 1_000_000, "<answer>" * 100_000 + "3",
                 "1*" * 500_000 + "1"):
        assert countdown_reward((3,), 3, text) == 0.0


# ---- agreement with reasoning-gym ------------------------------------------------------------


def _binary_operator_positions(text: str) -> list[int]:
    """Indices of + - * / that join two operands (not unary signs)."""
    positions, previous = [], ""
    for i, ch in enumerate(text):
        if ch in "+-*/" and (previous.isdigit() or previous == ")"):
            positions.append(i)
        if not ch.isspace():
            previous = ch
    return positions


def _answers(entry: dict) -> list[tuple[str, str]]:
    """(kind, answer) for one reasoning-gym problem: correct forms, wrong values, wrong number use."""
    ref, numbers, target = entry["answer"], entry["metadata"]["numbers"], entry["metadata"]["target"]
    out = [("correct", ref), ("correct", ref.replace(" ", "")), ("correct", f"({ref})"), ("correct", f"-(-({ref}))")]
    for k, i in enumerate(_binary_operator_positions(ref)[:3]):  # one operator changed
        swapped = {"+": "-*", "-": "+*", "*": "+-", "/": "*+"}[ref[i]][k % 2]
        out.append(("wrong value", ref[:i] + swapped + ref[i + 1:]))
    out.append(("wrong value", f"-({ref})"))
    n = numbers[0]
    out += [("wrong numbers", f"{ref} + {n} - {n}"),  # the right value, a number used three times
            ("wrong numbers", str(target)),  # the right value, the given numbers unused
            ("wrong numbers", re.sub(r"[0-9]+", lambda m: str(int(m.group()) + 1000), ref, count=1))]
    return out


def _exact(text: str) -> Fraction:
    return eval(re.sub(r"[0-9]+", r"Fraction(\g<0>)", text), {"Fraction": Fraction})


def _check_agreement(entries: list[dict]) -> dict[str, int]:
    """Both scorers give 1 to the same answers, bare and inside <answer> tags after some reasoning."""
    from reasoning_gym.games.countdown import CountdownConfig, CountdownDataset
    from reasoning_gym.utils import extract_answer

    rg = CountdownDataset(CountdownConfig(size=1, seed=0))
    counts = {"correct": 0, "wrong value": 0, "wrong numbers": 0}
    for entry in entries:
        numbers, target = tuple(entry["metadata"]["numbers"]), entry["metadata"]["target"]
        for kind, answer in _answers(entry):
            try:
                value = _exact(answer)
            except ZeroDivisionError:
                value = None
            if value is not None and value != target and abs(value - target) <= 1e-6 + 1e-5 * target:
                continue  # within reasoning-gym's float tolerance: a deliberate difference (below)
            completion = f"{numbers} -> {target}? Try things.\n<answer>\n{answer}\n</answer>"
            theirs = rg.score_answer(answer, entry) == 1.0
            assert theirs == (rg.score_answer(extract_answer(completion), entry) == 1.0)
            assert (countdown_reward(numbers, target, answer) == 1.0) == theirs, (kind, answer, entry["metadata"])
            assert (countdown_reward(numbers, target, completion) == 1.0) == theirs, (kind, completion)
            if kind == "correct":
                assert theirs, answer
            elif kind == "wrong numbers":
                assert not theirs, answer
            counts[kind] += theirs is (kind == "correct")
    return counts


def _reasoning_gym_entries(size: int, seed: int, **config) -> list[dict]:
    from reasoning_gym.games.countdown import CountdownConfig, CountdownDataset

    dataset = CountdownDataset(CountdownConfig(size=size, seed=seed, **config))
    return [dataset[i] for i in range(size)]


def test_agrees_with_reasoning_gym_on_its_problems():
    pytest.importorskip("reasoning_gym")
    entries = _reasoning_gym_entries(30, seed=21)
    counts = _check_agreement(entries)
    assert counts["correct"] == 4 * 30 and counts["wrong numbers"] == 3 * 30
    assert counts["wrong value"] >= 3 * 30  # (an operator swapped can keep the value: those score 1 in both)


@pytest.mark.slow
def test_agrees_with_reasoning_gym_on_hundreds_of_problems():
    pytest.importorskip("reasoning_gym")
    default = _reasoning_gym_entries(300, seed=2026)  # 4-6 numbers up to 100, targets 100-999, + - * /
    larger = _reasoning_gym_entries(50, seed=2027, min_numbers=10, max_numbers=15, max_target=10_000)
    assert sum(e["answer"].lstrip().startswith("-") for e in default + larger) >= 10  # unary minus covered
    assert sum(len(e["answer"]) > 64 for e in larger) >= 5  # long answers covered
    counts = _check_agreement(default + larger)
    assert counts["correct"] == 4 * 350 and counts["wrong numbers"] == 3 * 350
    assert counts["wrong value"] >= 3 * 350


def test_reasoning_gym_accepts_meshtron_demonstrations():
    pytest.importorskip("reasoning_gym")
    from reasoning_gym.games.countdown import CountdownConfig, CountdownDataset

    rg = CountdownDataset(CountdownConfig(size=1, seed=0))
    env = Countdown(num_numbers=4, max_number=20, max_target=200, operators="+-*/")
    for problem in env.get_dataset("train", 200, seed=3):
        numbers, target = problem.data
        entry = {"metadata": {"numbers": list(numbers), "target": target}}
        assert rg.score_answer(problem.solution, entry) == 1.0 and env.get_reward(problem, problem.solution) == 1.0


def test_deliberate_differences_from_reasoning_gym():
    """What reasoning-gym (sympy's parser, a float comparison) accepts and meshtron does not."""
    pytest.importorskip("reasoning_gym")
    from reasoning_gym.games.countdown import CountdownConfig, CountdownDataset

    rg = CountdownDataset(CountdownConfig(size=1, seed=0))
    cases = [((7, 3, 20), 22, "7//3+20"),  # floor division, Python's reading
             ((2, 3, 14), 22, "2**3+14"),  # power
             ((1000, 1, 200), 1000, "1000+1/200"),  # 1000.005: within numpy.isclose's rtol 1e-5
             ((3, 5, 7, 0), 22, "3*5+7.0")]  # a float literal whose digits are given numbers (7 and 0)
    for numbers, target, answer in cases:
        entry = {"metadata": {"numbers": list(numbers), "target": target}}
        assert rg.score_answer(answer, entry) == 1.0 and countdown_reward(numbers, target, answer) == 0.0, answer
    # partial credit: reasoning-gym gives 0.05 to parsable wrong answers and 0.01 to the rest;
    # meshtron env.format_reward (default 0) to right numbers with a wrong value and 0 to the rest
    entry = {"metadata": {"numbers": [3, 5, 7], "target": 22}}
    assert rg.score_answer("3*(5+7)", entry) == 0.05 and countdown_reward((3, 5, 7), 22, "3*(5+7)", 0.1) == 0.1
    assert rg.score_answer("3*5+", entry) == 0.01 and countdown_reward((3, 5, 7), 22, "3*5+") == 0.0


def test_arithmetic_reads_its_answer_by_the_same_rule():
    from meshtron.rl.arithmetic import arithmetic_reward

    for completion, reward in (("28", 1.0), ("\n28\n", 1.0), ("7*3=21, 21+12-5\n28", 1.0), ("28\nor 29", 0.0),
                               ("<answer>28</answer>", 1.0), ("-28", 0.0), ("2_8", 0.0), ("+28", 0.0),
                               ("\u0662\u0668", 0.0), ("28.0", 0.0)):
        assert arithmetic_reward(28, completion) == reward, completion
    assert arithmetic_reward(-3, "-3") == 1.0
