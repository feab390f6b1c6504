"""Mixed-batch sampling: each row of the logits has its own SamplingParams and its own generator.

Order, as vLLM and transformers apply them: logit bias, min_tokens, penalties (these read the
request's tokens), then temperature, top-k, top-p on what top-k kept (renormalised), min-p.
Filters run row-wise on the whole batch, so a row's result does not depend on the rows beside it;
the random draw uses the request's own `torch.Generator`, so a seeded request samples the same
tokens whatever it is batched with. Greedy rows take the argmax of the processed logits.
Log probabilities, when asked for, are those of the model's raw distribution (before any of the
above), as OpenAI reports them; with `logprobs_mode='processed'` those of the distribution sampled
from (after temperature and filtering; a greedy row keeps the raw ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from meshtron.inference.request import Request, SamplingParams, TokenLogProbs
from meshtron.inference.scheduler import SampledToken


def filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits (rows, vocab) fp32, already divided by temperature -> filtered entries at -inf."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=logits.dtype)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    # top-k keeps every token tied with the k-th largest logit, as transformers' and vLLM's top-k do
    kth = sorted_logits.gather(-1, (top_k - 1)[:, None])
    drop_sorted = sorted_logits < kth
    probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(-1)  # what top-k kept, renormalised
    # top-p: drop a token when the tokens ranked above it already hold top_p of the mass
    drop_sorted |= (probs.cumsum(-1) - probs > top_p[:, None]) & (top_p < 1)[:, None]
    drop_sorted |= probs < min_p[:, None] * probs[:, :1]
    drop_sorted[:, 0] = False  # the most likely token always survives
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def process_rows(logits: torch.Tensor, params: list[SamplingParams],
                 requests: Sequence[Optional[Request]]) -> torch.Tensor:
    """logits (rows, vocab) fp32 -> a copy with logit bias, min_tokens and penalties applied (the
    same tensor when no row asks for any)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias or p.has_penalties or p.min_tokens]
    if not rows:
        return logits
    logits, vocab = logits.clone(), logits.shape[-1]
    for i in rows:  # a loop over the rows that ask: penalties need each request's own token counts
        p, request, row = params[i], requests[i], logits[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
        if request is None:
            continue
        if request.num_output_tokens < p.min_tokens:
            stops = [*p.stop_token_ids, *([] if request.eos_token_id is None else [request.eos_token_id])]
            row[torch.tensor(stops, dtype=torch.long, device=logits.device)] = float("-inf")
        if p.has_penalties:
            _penalise(row, p, request, vocab)
    return logits


def _penalise(row: torch.Tensor, p: SamplingParams, request: Request, vocab: int) -> None:
    """vLLM's definitions, in place on one row of logits."""
    output = torch.tensor(request.output_token_ids, dtype=torch.long, device=row.device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(request.prompt_token_ids, dtype=torch.long, device=row.device)] = True
        penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalised, row))
    row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                req_ids: list[str], requests: Optional[Sequence[Optional[Request]]] = None) -> dict[str, SampledToken]:
    """logits (rows, vocab) of each sampling request's last token -> req_id -> sampled token.
    `requests` (the requests' tokens so far) are needed for penalties and min_tokens.
    A row that cannot be sampled (NaN or +inf logits, no probability mass left) gets an error
    instead of a token; the other rows are sampled exactly as they would be without it."""
    raw = logits.float()
    logits = process_rows(raw, params, requests if requests is not None else [None] * len(params))
    # a row is unusable with NaN/+inf logits or (sampled rows) no finite probability mass; checked in one
    # host read before multinomial, which raises on a CPU but trips a device assert on a GPU
    # argmax treats NaN as the largest value, so a row's arg-max logit is NaN when any is, else +inf when
    # any is, else -inf only when all are: one pass and a gather instead of three passes over the vocab
    token_ids = logits.argmax(-1)
    unusable = ~logits.gather(-1, token_ids[:, None])[:, 0].isfinite()
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    log_prob_logits = raw
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        temperature = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        scaled = filter_rows(logits[index] / temperature[:, None], [params[i] for i in random_rows])
        probs = scaled.softmax(-1)
        unusable[index] |= (~probs.isfinite()).any(-1) | (probs.sum(-1) <= 0)
    flags = unusable.tolist()
    errors = ["this request could not be sampled: its logits or probabilities are not finite (check temperature)"
              if bad else None for bad in flags]
    if random_rows:
        for j, i in enumerate(random_rows):
            if not flags[i]:
                token_ids[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
        processed = [j for j, i in enumerate(random_rows) if params[i].return_log_probs
                     and params[i].logprobs_mode == "processed"]
        if processed:
            log_prob_logits = raw.clone()
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
