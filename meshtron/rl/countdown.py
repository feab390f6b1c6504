"""Countdown: given numbers and a target, write an arithmetic expression that uses every number
exactly once and evaluates to the target.

Prompt `"3 5 7 -> 22: "`, a good completion `"3*5+7"` (ended by the end-of-document token). The
reward judges the mathematics, not the typography:
- the answer is the text inside the last `<answer>...</answer>` pair when the completion has one
  (the convention of reasoning prompts), else the last non-empty line of the completion;
- an expression is decimal integer literals, binary + - * /, unary minus and plus, parentheses and
  blanks, read by the small parser below (not Python's: `//`, `**`, `1_0`, `0x1f`, `3.0`, `07` are
  refused), evaluated exactly with fractions;
- there is no length limit; pathological input is bounded instead: at most MAX_NODES numbers and
  operators, MAX_DIGITS digits per number and MAX_DEPTH open parentheses, so the exact arithmetic
  stays small and the work linear in the answer's length whatever the model wrote.
The reward is
    1.0            the numbers used are exactly the given ones (each once) and the value is the target
    format_reward  the numbers are right but the value is not
    0.0            wrong numbers (missing, extra, repeated) or anything that does not parse
Problems are generated: random numbers, a random expression tree over them, the target its value
(a positive integer up to max_target); the expression is the demonstration for the warm-up. The
prompt lists the numbers in a random order, so several answers are right and the demonstration is
one of them.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction
from typing import Optional, Union

from meshtron.rl.environments import GeneratedDataset, Problem

MAX_NODES = 256  # numbers plus operators (unary ones included) in one answer
MAX_DIGITS = 30  # digits in one number
MAX_DEPTH = 256  # parentheses open at once
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_UNARY = {"u-", "u+"}  # unary minus and plus: they bind tighter than * and / (the value is the same either way)
_TOKEN = re.compile(r"\s*(?:([0-9]+)|(.))", re.DOTALL)

Node = Union[int, tuple[str, "Node", "Node"]]


class MalformedExpression(ValueError):
    pass


def _to_postfix(text: str) -> list[Union[int, str]]:
    """Shunting-yard without recursion: integers and operators in evaluation order. Raises
    MalformedExpression for any character, literal or arrangement that is not an expression."""
    out: list[Union[int, str]] = []
    stack: list[str] = []  # operators and "("
    want_operand, num_nodes, depth = True, 0, 0
    for m in _TOKEN.finditer(text.rstrip()):
        digits, char = m.groups()
        if digits is not None or char in "+-*/":
            num_nodes += 1
            if num_nodes > MAX_NODES:
                raise MalformedExpression(f"more than {MAX_NODES} numbers and operators")
        if digits is not None:
            if not want_operand:
                raise MalformedExpression(f"a number where an operator belongs: {digits}")
            if len(digits) > MAX_DIGITS or (len(digits) > 1 and digits[0] == "0"):
                raise MalformedExpression(f"not a number of the puzzle: {digits[:MAX_DIGITS]}")
            out.append(int(digits))
            want_operand = False
        elif want_operand and char in "+-":
            stack.append("u" + char)
        elif want_operand and char == "(":
            stack.append("(")
            depth += 1
            if depth > MAX_DEPTH:
                raise MalformedExpression(f"parentheses nested more than {MAX_DEPTH} deep")
        elif not want_operand and char in _PRECEDENCE:
            while stack and stack[-1] != "(" and (stack[-1] in _UNARY or _PRECEDENCE[stack[-1]] >= _PRECEDENCE[char]):
                out.append(stack.pop())
            stack.append(char)
            want_operand = True
        elif not want_operand and char == ")":
            while stack and stack[-1] != "(":
                out.append(stack.pop())
            if not stack:
                raise MalformedExpression("unbalanced ')'")
            stack.pop()
            depth -= 1
        else:
            raise MalformedExpression(f"unexpected {char!r}")
    if want_operand:
        raise MalformedExpression("the expression ends early" if out or stack else "empty")
    while stack:
        if stack[-1] == "(":
            raise MalformedExpression("unbalanced '('")
        out.append(stack.pop())
    return out


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
    """-> (exact value, the integer literals in order); MalformedExpression for anything else."""
    values: list[Fraction] = []
    numbers: list[int] = []
    for item in _to_postfix(text):
        if isinstance(item, int):
            numbers.append(item)
            values.append(Fraction(item))
        elif item in _UNARY:
            values[-1] = -values[-1] if item == "u-" else values[-1]
        else:
            b, a = values.pop(), values.pop()
            if item == "/" and b == 0:
                raise MalformedExpression("division by zero")
            values.append(a + b if item == "+" else a - b if item == "-" else a * b if item == "*" else a / b)
    assert len(values) == 1
    return values[0], numbers


def completion_text(completion: str) -> str:
    """The one answer of a completion: inside the last <answer>...</answer> pair if there is one, else
    the last non-empty line; stripped."""
    end = completion.rfind("</answer>")
    start = completion.rfind("<answer>", 0, end) if end >= 0 else -1
    if start >= 0:
        return completion[start + len("<answer>"):end].strip()
    text = completion.strip()
    return text.splitlines()[-1].strip() if text else ""


def countdown_reward(numbers: tuple[int, ...], target: int, completion: str, format_reward: float = 0.0) -> float:
    try:
        result, used = parse_expression(completion_text(completion))
    except MalformedExpression:
        return 0.0
    if sorted(used) != sorted(numbers):
        return 0.0
    return 1.0 if result == target else format_reward


def render(node: Node, parent_op: Optional[str] = None, right: bool = False) -> str:
    """An expression tree as text with only the parentheses precedence needs."""
    if isinstance(node, int):
        return str(node)
    op, a, b = node
    text = render(a, op, False) + op + render(b, op, True)
    if parent_op is not None:
        p, q = _PRECEDENCE[parent_op], _PRECEDENCE[op]
        if q < p or (right and q == p and parent_op in "-/"):
            return f"({text})"
    return text


def evaluate(node: Node) -> Fraction:
    if isinstance(node, int):
        return Fraction(node)
    op, a, b = node
    x, y = evaluate(a), evaluate(b)
    if op == "/":
        return x / y if y != 0 else Fraction(10**9)  # never a valid target
    return x + y if op == "+" else x - y if op == "-" else x * y


def random_tree(numbers: list[int], operators: str, rng: random.Random) -> Node:
    if len(numbers) == 1:
        return numbers[0]
    k = rng.randint(1, len(numbers) - 1)
    return (rng.choice(operators), random_tree(numbers[:k], operators, rng), random_tree(numbers[k:], operators, rng))


class Countdown:
    name = "countdown"

    def __init__(self, num_numbers: int = 3, max_number: int = 9, max_target: int = 100, operators: str = "+-*",
                 format_reward: float = 0.0, eval_percent: float = 10.0):
        bad = set(operators) - set(_PRECEDENCE)
        if bad or not operators:
            raise ValueError(f"countdown operators {operators!r}: use some of '+-*/'")
        self.num_numbers, self.max_number, self.max_target = num_numbers, max_number, max_target
        self.operators, self.format_reward, self.eval_percent = operators, format_reward, eval_percent

    def make(self, rng: random.Random) -> tuple[str, Problem]:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            tree = random_tree(numbers, self.operators, rng)
            value = evaluate(tree)
            if value.denominator == 1 and 0 < value <= self.max_target:
                target = int(value)
                key = f"{sorted(numbers)}={target}"
                shown = rng.sample(numbers, len(numbers))  # the prompt does not give away the solution's order
                return key, Problem(self.name, (tuple(shown), target), solution=render(tree))

    def get_dataset(self, split: str, size: int, seed: int) -> GeneratedDataset:
        return GeneratedDataset(self.make, split, size, seed, self.eval_percent)

    def get_prompt(self, problem: Problem) -> str:
        numbers, target = problem.data
        return f"{' '.join(map(str, numbers))} -> {target}: "

    def get_reward(self, problem: Problem, completion: str) -> float:
        numbers, target = problem.data
        return countdown_reward(numbers, target, completion, self.format_reward)
