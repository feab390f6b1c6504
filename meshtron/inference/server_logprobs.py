"""Log probabilities as the OpenAI-compatible API writes them: the legacy completions object (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`), which with `echo` starts with the prompt's tokens (the
first with null entries: nothing predicts it), and vLLM's `prompt_logprobs` list. A log prob of -inf
is written as MIN_LOG_PROB (JSON has no infinity; OpenAI's clients expect a number).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from meshtron.inference.request import TokenLogProbs

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

MIN_LOG_PROB = -9999.0


def finite_log_prob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOG_PROB


class TokenTexts:
    """tokenizer.decode([id]) once per id (an echo repeats ids, and each position names k alternatives)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = self.tokenizer.decode([token_id])
        return text


@dataclass
class EchoedPrompt:
    """The prompt at the start of an echoed choice: its ids, their log probs (None first, as the
    engine's `RequestOutput.prompt_log_probs`) and the echoed text."""

    token_ids: list[int]
    log_probs: list[Optional[TokenLogProbs]]
    text: str


def legacy_log_probs(tokenizer, items: list[TokenLogProbs], offset: int, as_token_ids: bool = False,
                     prompt: Optional[EchoedPrompt] = None, num_top: Optional[int] = None) -> Optional[dict[str, Any]]:
    """The legacy completions `logprobs` object: the echoed `prompt`'s tokens (if given), then `items`.

    `top_logprobs` holds the `num_top` most likely tokens and, as OpenAI documents, the chosen one (so
    up to num_top + 1 entries). `text_offset` is where each token's text starts in the choice's text:
    the per-token texts added up (as vLLM), those of the prompt from 0 (never past the echoed text),
    those of `items` from `offset`. With `as_token_ids` tokens and keys read "token_id:N" (vLLM's
    return_tokens_as_token_ids), so a client gets the exact ids."""
    text = TokenTexts(tokenizer)
    name: Callable[[int], str] = (lambda i: f"token_id:{i}") if as_token_ids else text
    tokens, values, tops, offsets = [], [], [], []
    if prompt is not None:
        assert len(prompt.log_probs) == len(prompt.token_ids), "an echo with log probs needs the prompt's"
        at = 0
        for token_id, lp in zip(prompt.token_ids, prompt.log_probs):
            tokens.append(name(token_id))
            offsets.append(min(at, len(prompt.text)))
            at += len(text(token_id))
            values.append(None if lp is None else finite_log_prob(lp.log_prob))
            tops.append(None if lp is None else _top(lp, num_top, name))
    at = offset
    for lp in items:
        tokens.append(name(lp.token_id))
        offsets.append(at)
        at += len(text(lp.token_id))
        values.append(finite_log_prob(lp.log_prob))
        tops.append(_top(lp, num_top, name))
    if not tokens:
        return None
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top(lp: TokenLogProbs, num_top: Optional[int], name: Callable[[int], str]) -> dict[str, float]:
    top = {name(i): finite_log_prob(v) for i, v in lp.top[:num_top]}
    top.setdefault(name(lp.token_id), finite_log_prob(lp.log_prob))
    return top


def prompt_log_probs(tokenizer, log_probs: list[Optional[TokenLogProbs]], k: int) -> list[Optional[dict[str, Any]]]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {"<token id>": {"logprob",
    "rank", "decoded_token"}} for the prompt token (first) and the k most likely tokens at its position.
    `rank` is 1 for the most likely; null for a prompt token outside the k (its rank is not computed)."""
    text = TokenTexts(tokenizer)
    out: list[Optional[dict[str, Any]]] = []
    for lp in log_probs:
        if lp is None:
            out.append(None)
            continue
        top = lp.top[:k]
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(top, 1)}
        entry = {str(lp.token_id): {"logprob": finite_log_prob(lp.log_prob), "rank": ranks.get(lp.token_id),
                                    "decoded_token": text(lp.token_id)}}
        for token_id, value in top:
            entry.setdefault(str(token_id), {"logprob": finite_log_prob(value), "rank": ranks[token_id],
                                             "decoded_token": text(token_id)})
        out.append(entry)
    return out
