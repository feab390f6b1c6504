"""Countdown: given numbers and a target, write an arithmetic expression that uses every number
exactly once and evaluates to the target.

Prompt `"3 5 7 -> 22: "`, a good completion `"3*5+7"` (ended by the end-of-document token or a
newline). The reward parses the completion with Python's `ast` (integers, + - * /, parentheses; no
unary minus, no other syntax), evaluates it exactly with fractions, and gives
    1.0            the numbers used are exactly the given ones and the value is the target
    format_reward  the numbers are right but the value is not
    0.0            wrong numbers (missing, extra, repeated) or anything that does not parse
Problems are generated: random numbers, a random expression tree over them, the target its value
(a positive integer up to max_target); the expression is the demonstration for the warm-up. The
prompt lists the numbers in a random order, so several answers are right and the demonstration is
one of them.
"""

from __future__ import annotations

import ast
import random
from fractions import Fraction
from typing import Optional, Union

from meshtron.rl.environments import GeneratedDataset, Problem

MAX_COMPLETION_CHARS = 64
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}

Node = Union[int, tuple[str, "Node", "Node"]]


class MalformedExpression(ValueError):
    pass


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
    """-> (exact value, the integer literals in order); MalformedExpression for anything else."""
    if len(text) > MAX_COMPLETION_CHARS:
        raise MalformedExpression("too long")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise MalformedExpression(str(e)) from None
    numbers: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = value(node.left), value(node.right)
            op = _OPS[type(node.op)]
            if op == "/":
                if b == 0:
                    raise MalformedExpression("division by zero")
                return a / b
            return a + b if op == "+" else a - b if op == "-" else a * b
        raise MalformedExpression(f"{type(node).__name__} is not allowed")

    return value(tree), numbers


def completion_text(completion: str) -> str:
    """The part of a completion that is the answer: up to the first newline, stripped."""
    return completion.split("\n", 1)[0].strip()


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
