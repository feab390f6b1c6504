"""Mixed-batch sampling: each row of the logits has its own SamplingParams and its own generator.

Filters run row-wise on the whole batch (temperature, top-k, top-p, min-p), so a row's result does
not depend on the rows beside it; the random draw uses the request's own `torch.Generator`, so a
seeded request samples the same tokens whatever it is batched with. Greedy rows take the argmax.
Log probabilities, when asked for, are those of the model's raw distribution (before temperature
and filtering), as OpenAI reports them; with `logprobs_mode='processed'` those of the distribution
sampled from (after temperature and filtering; a greedy row keeps the raw ones).
"""

from __future__ import annotations

from typing import Optional

import torch

from meshtron.inference.request import SamplingParams, TokenLogProbs
from meshtron.inference.scheduler import SampledToken


def filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits (rows, vocab) fp32, already divided by temperature -> filtered entries at -inf."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=logits.dtype)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop_sorted = rank >= top_k[:, None]
    probs = sorted_logits.softmax(-1)
    # top-p: drop a token when the tokens ranked above it already hold top_p of the mass
    drop_sorted |= (probs.cumsum(-1) - probs > top_p[:, None]) & (top_p < 1)[:, None]
    drop_sorted |= probs < min_p[:, None] * probs[:, :1]
    drop_sorted[:, 0] = False  # the most likely token always survives
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                req_ids: list[str]) -> dict[str, SampledToken]:
    """logits (rows, vocab) of each sampling request's last token -> req_id -> sampled token.
    A row that cannot be sampled (NaN or +inf logits, no probability mass left) gets an error
    instead of a token; the other rows are sampled exactly as they would be without it."""
    logits = logits.float()
    errors: list[Optional[str]] = [None] * len(params)
    bad_logits = (logits.isnan() | logits.isposinf()).any(-1) | logits.isneginf().all(-1)
    for i in bad_logits.nonzero()[:, 0].tolist():  # one host sync per step; empty unless something broke
        errors[i] = "the model produced non-finite logits for this request; it was not sampled"
    token_ids = logits.argmax(-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy and errors[i] is None]
    log_prob_logits = logits
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        temperature = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        scaled = filter_rows(logits[index] / temperature[:, None], [params[i] for i in random_rows])
        probs = scaled.softmax(-1)
        # checked before multinomial, which raises on CPU but trips a device assert on a GPU
        unusable = ((~probs.isfinite()).any(-1) | (probs.sum(-1) <= 0)).tolist()
        for j, i in enumerate(random_rows):
            if unusable[j]:
                errors[i] = "sampling failed for this request: its probabilities are not finite; check temperature"
                continue
            token_ids[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
        processed = [j for j, i in enumerate(random_rows) if params[i].return_log_probs
                     and params[i].logprobs_mode == "processed"]
        if processed:
            log_prob_logits = logits.clone()
            log_prob_logits[index[processed]] = scaled[processed]
    log_probs = _log_probs(log_prob_logits, token_ids, params)
    ids = token_ids.tolist()
    return {req_id: SampledToken(ids[i], log_probs[i]) if errors[i] is None else SampledToken(-1, None, errors[i])
            for i, req_id in enumerate(req_ids)}


def _log_probs(logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]) -> list:
    rows = [i for i, p in enumerate(params) if p.return_log_probs]
    out: list = [None] * len(params)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    log_probs = logits[index].log_softmax(-1)
    chosen = log_probs.gather(-1, token_ids[index][:, None])[:, 0].tolist()
    num_top = max(params[i].top_log_probs for i in rows)
    top_values, top_ids = log_probs.topk(num_top, dim=-1) if num_top else (None, None)
    for j, i in enumerate(rows):
        n = params[i].top_log_probs
        top = list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist())) if n else []
        out[i] = TokenLogProbs(int(token_ids[i]), chosen[j], top)
    return out
