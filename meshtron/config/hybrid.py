"""Hybrid layer patterns: the sublayer symbols, and a pattern derived from target ratios.

A model is one residual sublayer per symbol of `LAYER_SYMBOLS`, the one list of them: models/blocks.py
maps each to its mixer and size, parallel/tensor_parallel.py to its tensor-parallel plan.
`pattern_from_ratios(n, attention_ratio, mlp_ratio)` spreads round(n * attention_ratio) attention
sublayers and round(n * mlp_ratio) MLP sublayers evenly over n slots and fills the rest with
Mamba. Attention goes first, each at the middle of its 1/k-th of the stack (so the stack starts
and ends with Mamba); the MLPs then take the middles of their shares of the slots left over.
A given pattern string overrides the derivation (`check_pattern` validates it).
"""

from __future__ import annotations

from meshtron.config.fields import ConfigError

LAYER_SYMBOLS = {"*": "attention", "-": "dense MLP", "M": "Mamba-2", "E": "mixture of experts"}


def _evenly(slots: list[int], count: int) -> list[int]:
    """`count` of `slots`, each the middle one of its equal share of them."""
    return [slots[int((k + 0.5) * len(slots) / count)] for k in range(count)]


def pattern_from_ratios(num_sublayers: int, attention_ratio: float, mlp_ratio: float) -> str:
    """E.g. pattern_from_ratios(8, 0.25, 0.25) == "M-*MM-*M"; the rest are Mamba sublayers."""
    num_attention, num_mlp = round(num_sublayers * attention_ratio), round(num_sublayers * mlp_ratio)
    assert num_attention + num_mlp <= num_sublayers, "ratios are validated by ModelConfig"
    symbols = ["M"] * num_sublayers
    for i in _evenly(list(range(num_sublayers)), num_attention) if num_attention else []:
        symbols[i] = "*"
    free = [i for i, s in enumerate(symbols) if s == "M"]
    for i in _evenly(free, num_mlp) if num_mlp else []:
        symbols[i] = "-"
    return "".join(symbols)


def check_pattern(pattern: str, symbols: dict[str, str] = LAYER_SYMBOLS, field: str = "model.layer_pattern") -> None:
    """One-line ConfigError for an empty pattern or one with symbols outside `symbols`."""
    allowed = ", ".join(f"'{s}' {n}" for s, n in symbols.items())
    if not pattern:
        raise ConfigError(f"{field}: the pattern is empty; give at least one of {allowed}")
    bad = sorted(set(pattern) - set(symbols))
    if bad:
        where = pattern.index(bad[0])
        raise ConfigError(f"{field}: {pattern!r} is not allowed; unknown symbol(s) {bad} (first at index {where}); "
                          f"use {allowed}")
