"""Speculative decoding: a cheap drafter proposes k tokens per request, the target model verifies them
in one forward (the k + 1 tokens [last token, d_1 .. d_k] are one chunk of the ordinary paged
prefill path), and the standard rejection rule keeps the output distribution exactly the target's:
draft d_j (drawn from q_j) is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first
rejection the token is drawn from normalize(max(0, p_j - q_j)); when all k are accepted a bonus
token is drawn from p_{k+1}. p and q are both the distribution the sampler draws from (penalties,
logit bias and min_tokens read the tokens before each position, then temperature, top-k, top-p,
min-p: `sampler.process_rows` / `filter_rows`). Greedy rows accept while the argmax matches.
Every draw (drafts, k uniforms, the final token) uses the request's own generator, in a fixed order.

Drafters (both keep keys/values in paged caches addressed by the target's block tables, so
preemption, prefix caching and rollback need nothing of their own):
- `MTPDrafter`: the model's own multi-token-prediction depth 1 (models/mtp.py). After each target
  forward it runs over the positions the target just computed, with the target's last hidden state
  at position i and the embedding of token t_{i+1}; its logits at the last position give d_1. Further
  drafts reuse depth 1: position i + 1 takes depth 1's own output at i as its hidden state and the
  embedding of the previous draft (depths 2..D are not used: their inputs at a position need
  tokens that are not known yet). Its attention is keyed by its own layer id in the target's cache.
- `DraftModelDrafter`: a separate small model with the same vocabulary and its own cache tensors;
  it reads the tokens the target computed, then feeds the bonus token and each draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import nn

from meshtron.inference.mamba_state import MambaInferenceStateConfig
from meshtron.inference.paged_context import PagedKVCache
from meshtron.inference.request import Request, SamplingParams
from meshtron.inference.sampler import _log_probs, filter_rows, process_rows, sample_rows
from meshtron.inference.scheduler import SampledToken, ScheduledChunk, SchedulerOutput
from meshtron.inference.varlen_context import build_varlen_batch

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

METHODS = ("none", "mtp", "draft")


@dataclass
class TokensSoFar:
    """What `process_rows` reads of a request, as it would be at a later position: the request's
    tokens plus the drafts before that position (penalties and min_tokens depend on them)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: Optional[int]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def tokens_so_far(request: Request, extra: list[int]) -> TokensSoFar:
    return TokensSoFar(request.prompt_token_ids, request.output_token_ids + list(extra), request.eos_token_id)


def sampling_rows(logits: torch.Tensor, params: SamplingParams, prefixes: list[TokensSoFar]
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits (rows, vocab) of one request at successive positions -> (processed logits, the
    probabilities the sampler draws from, None for a greedy request), as `sampler.sample_rows` makes them."""
    processed = process_rows(logits.float(), [params] * len(prefixes), prefixes)
    if params.greedy:
        return processed, None
    scaled = filter_rows(processed / params.temperature, [params] * len(prefixes))
    return scaled, scaled.softmax(-1)


def accept_drafts(p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor, uniforms: torch.Tensor) -> int:
    """The rejection rule: p, q (k, vocab), draft_ids and uniforms (k,) -> how many leading drafts
    are accepted (draft j with probability min(1, p_j(d_j) / q_j(d_j)))."""
    rows = torch.arange(len(draft_ids), device=p.device)
    ok = (uniforms * q[rows, draft_ids] < p[rows, draft_ids]).tolist()
    return ok.index(False) if False in ok else len(ok)


def unusable(logits: torch.Tensor, probs: Optional[torch.Tensor]) -> bool:
    """The sampler's test: NaN or +inf logits, or no finite probability mass."""
    bad = bool(((logits.isnan() | logits.isposinf()).any(-1) | logits.isneginf().all(-1)).any())
    return bad or (probs is not None and bool(((~probs.isfinite()).any(-1) | (probs.sum(-1) <= 0)).any()))


UNUSABLE = "this request could not be sampled: its logits or probabilities are not finite (check temperature)"


@dataclass
class SpecStats:
    """Totals over the engine's life (per request they live on the Request)."""

    num_draft_tokens: int = 0  # drafts verified by the target
    num_accepted_tokens: int = 0
    num_verify_rows: int = 0  # target forwards of a request that had drafts
    num_output_tokens: int = 0  # tokens those forwards produced (accepted drafts + the final one)

    def as_dict(self) -> dict:
        return {"num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
                "tokens_per_verify": (self.num_output_tokens / self.num_verify_rows if self.num_verify_rows else None)}


@dataclass
class Pending:
    """What a request that sampled this step drafts from once its tokens are applied."""

    logits: Optional[torch.Tensor] = None  # MTP: (vocab,) depth 1's logits at the last computed position
    hidden: Optional[torch.Tensor] = None  # MTP: (hidden,) depth 1's output there


@dataclass
class SpeculativeDecoder:
    """Owned by the runner: verifies each step's drafts and proposes the next ones."""

    runner: object  # the ModelRunner (its forward, generators, params and requests)
    drafter: object
    num_speculative_tokens: int
    draft_probs: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # req_id -> (k, vocab) or None
    pending: dict[str, Pending] = field(default_factory=dict)
    stats: SpecStats = field(default_factory=SpecStats)

    def forget(self, req_id: str) -> None:
        self.draft_probs.pop(req_id, None)
        self.pending.pop(req_id, None)

    def release(self) -> None:
        """Suspend: free a draft model's cache tensors (drafts and their distributions stay with the
        requests, which are recomputed on resume)."""
        cache = getattr(self.drafter, "cache", None)
        if cache is not None and cache is not self.runner.cache:
            cache.release()

    # ---- verify ---------------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """The target forward of the step: verify chunks with drafts, sample the others as the runner
        would, then let the drafter read what the target computed."""
        runner, chunks = self.runner, out.chunks
        self.pending = {}
        logits, _, batch = runner._eager_forward(chunks)  # (tokens, vocab)
        scoring = [c for c in chunks if runner._prompt_positions(c) is not None]
        runner.prompt_log_probs = (runner._score(scoring, logits, {c.req_id: i for i, c in enumerate(chunks)}, batch)
                                   if scoring else {})
        plain = [i for i, c in enumerate(chunks) if c.samples and not c.num_draft_tokens]
        sampled: dict[str, SampledToken] = {}
        if plain:
            ids = [chunks[i].req_id for i in plain]
            rows = torch.tensor([int(batch.token_index[i][-1]) for i in plain], device=logits.device)
            sampled = sample_rows(logits[rows], [runner.params[r] for r in ids], [runner.generators[r] for r in ids],
                                  ids, [runner.requests[r] for r in ids])
        for i, c in enumerate(chunks):
            if c.samples and c.num_draft_tokens:
                index = torch.from_numpy(batch.token_index[i][-(c.num_draft_tokens + 1):]).to(logits.device)
                sampled[c.req_id] = self._verify(c, logits[index])
        valid = []
        for c in chunks:  # tokens of each chunk whose keys/values stay (rejected drafts' do not)
            token = sampled.get(c.req_id)
            if token is not None and token.error:
                valid.append(0)
            else:
                accepted = len(token.accepted_draft_ids) if token is not None else 0
                valid.append(len(c.token_ids) - c.num_draft_tokens + accepted)
        self.drafter.catch_up(self, chunks, valid, sampled, batch)
        return sampled

    def _verify(self, chunk: ScheduledChunk, logits: torch.Tensor) -> SampledToken:
        """logits (k + 1, vocab) at [last token, d_1 .. d_k] -> the accepted drafts and the next token."""
        runner, req_id, k = self.runner, chunk.req_id, chunk.num_draft_tokens
        request, params, generator = runner.requests[req_id], runner.params[req_id], runner.generators[req_id]
        drafts = chunk.token_ids[-k:]
        scaled, p = sampling_rows(logits, params, [tokens_so_far(request, drafts[:j]) for j in range(k + 1)])
        if unusable(scaled, p):
            return SampledToken(-1, None, UNUSABLE)
        if p is None:  # greedy: accept while the target's argmax agrees
            target = scaled.argmax(-1).tolist()
            num_accepted = next((j for j in range(k) if target[j] != drafts[j]), k)
            final = target[num_accepted]
        else:
            q = self.draft_probs[req_id]
            assert q is not None and q.shape[0] >= k, f"{req_id}: drafts without their probabilities"
            draft_ids = torch.tensor(drafts, device=p.device)
            uniforms = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
            num_accepted = accept_drafts(p[:k], q[:k], draft_ids, uniforms)
            dist = p[num_accepted]
            if num_accepted < k:
                residual = (p[num_accepted] - q[num_accepted]).clamp_min(0)
                dist = residual if float(residual.sum()) > 0 else dist
            final = int(torch.multinomial(dist / dist.sum(), 1, generator=generator)[0])
        self.draft_probs.pop(req_id, None)
        emitted = drafts[:num_accepted] + [final]
        log_probs = [None] * len(emitted)
        if params.return_log_probs:
            source = scaled if p is not None and params.logprobs_mode == "processed" else logits.float()
            n = len(emitted)
            log_probs = _log_probs(source[:n], torch.tensor(emitted, device=logits.device), [params] * n)
        stats = self.stats
        stats.num_draft_tokens += k
        stats.num_accepted_tokens += num_accepted
        stats.num_verify_rows += 1
        stats.num_output_tokens += num_accepted + 1
        return SampledToken(final, log_probs[-1], accepted_draft_ids=emitted[:-1], accepted_log_probs=log_probs[:-1])

    # ---- propose --------------------------------------------------------------------------------

    def propose(self, requests: dict[str, Request], kv, max_model_len: int) -> None:
        """Draft up to k tokens for each running request that sampled this step (tokens applied):
        their slots are allocated in the target's block table, the drafts and their distributions kept."""
        todo = []
        for req_id, pending in self.pending.items():
            request = requests.get(req_id)
            if request is None or request.is_finished:
                continue
            params = request.sampling_params
            k = min(self.num_speculative_tokens, params.max_tokens - request.num_output_tokens - 1,
                    max_model_len - request.num_tokens)
            if k <= 0 or not kv.allocate_slots(request, request.num_tokens + k - request.num_computed_tokens):
                continue
            todo.append((request, pending, k))
        self.pending = {}
        if not todo:
            return
        drafts: dict[str, list[int]] = {r.req_id: [] for r, _, _ in todo}
        probs: dict[str, list[torch.Tensor]] = {r.req_id: [] for r, _, _ in todo}
        state = self.drafter.start(self, todo, kv)
        for j in range(max(k for _, _, k in todo)):
            live = [(r, p, k) for r, p, k in todo if k > j]
            logits = self.drafter.step(self, live, j, drafts, state, kv)  # (len(live), vocab)
            for row, (request, _, _) in enumerate(live):
                token, q = self._draw(request, logits[row:row + 1], drafts[request.req_id])
                if token is None:  # unusable draft logits: stop drafting this request
                    todo = [t for t in todo if t[0] is not request]
                    continue
                drafts[request.req_id].append(token)
                if q is not None:
                    probs[request.req_id].append(q)
        for request, _, _ in todo:
            request.spec_token_ids = drafts[request.req_id]
            rows = probs[request.req_id]
            self.draft_probs[request.req_id] = torch.stack(rows) if rows else None

    def _draw(self, request: Request, logits: torch.Tensor, drafts: list[int]
              ) -> tuple[Optional[int], Optional[torch.Tensor]]:
        params = request.sampling_params
        scaled, q = sampling_rows(logits, params, [tokens_so_far(request, drafts)])
        if unusable(scaled, q):
            return None, None
        if q is None:
            return int(scaled[0].argmax()), None
        generator = self.runner.generators[request.req_id]
        return int(torch.multinomial(q[0], 1, generator=generator)[0]), q[0]


def _chunk(req_id: str, token_ids: list[int], start: int, block_ids: list[int], samples: bool) -> ScheduledChunk:
    return ScheduledChunk(req_id, token_ids, start, block_ids, samples)


class MTPDrafter:
    """Drafts with depth 1 of the target's MTP layers; its keys/values share the target's cache
    (keyed by the depth's own layer id) and block tables."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, decode_attention):
        if not len(getattr(model, "mtp", ())):
            from meshtron.config.fields import ConfigError

            raise ConfigError("engine.speculative_method: 'mtp' needs a model with MTP depths (model.mtp_num_layers "
                              "is 0); train with model.mtp_num_layers >= 1, or use speculative_method draft")
        self.model, self.depth, self.cache, self.decode_attention = model, model.mtp[0], cache, decode_attention
        self.hidden: Optional[torch.Tensor] = None
        # the target's last hidden state (before its final norm) is the input of the final norm
        model.final_norm.register_forward_pre_hook(self._keep_hidden)

    def _keep_hidden(self, module, inputs) -> None:
        self.hidden = inputs[0]

    def _run(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object]:
        """hidden (1, T, d) of each chunk's positions, the chunks' tokens shifted by one -> (depth
        output (T, d), logits of the sampling rows, batch)."""
        batch = build_varlen_batch(chunks, self.cache, None, self.decode_attention)
        if self.model.rotary is not None:
            batch.ctx.rope = self.model.rotary(batch.ctx.positions)
        h = self.depth(hidden, self.model.embedding(batch.tokens), batch.ctx)[0]
        return h, self.model.head(self.depth.final_norm(h[batch.sample_index])), batch

    def catch_up(self, spec: SpeculativeDecoder, chunks: list[ScheduledChunk], valid: list[int],
                 sampled: dict[str, SampledToken], target_batch) -> None:
        """Depth 1 over every position the target computed and keeps: position i reads the target's
        hidden state at i and token t_{i+1} (the next prompt token, or the token just sampled)."""
        hidden, parts, index = self.hidden.reshape(-1, self.hidden.shape[-1]), [], []
        for i, (c, v) in enumerate(zip(chunks, valid)):
            if v == 0:
                continue
            token = sampled.get(c.req_id)
            nxt = token.token_id if token is not None else spec.runner.requests[c.req_id].token_at(c.start_pos + v)
            shifted = [*c.token_ids[1:v], nxt]
            parts.append(_chunk(c.req_id, shifted, c.start_pos, c.block_ids, token is not None))
            index.append(target_batch.token_index[i][:v])
        self.hidden = None
        if not parts:
            return
        rows = torch.from_numpy(np.concatenate(index)).to(hidden.device)
        h, logits, batch = self._run(parts, hidden[rows][None])
        last = h[batch.sample_index]
        for row, req_id in enumerate(batch.sample_req_ids):
            spec.pending[req_id] = Pending(logits[row], last[row])

    def start(self, spec, todo, kv) -> dict:
        return {r.req_id: (p.logits, p.hidden) for r, p, _ in todo}

    def step(self, spec, live, j: int, drafts: dict[str, list[int]], state: dict, kv) -> torch.Tensor:
        """Draft j (0-based): d_1 comes from the catch-up's logits; d_{j+1} runs depth 1 at position
        (last computed + j) on its own previous output and the embedding of d_j."""
        if j == 0:
            return torch.stack([state[r.req_id][0] for r, _, _ in live])
        chunks = [_chunk(r.req_id, [drafts[r.req_id][-1]], r.num_computed_tokens - 1 + j,
                         kv.block_ids(r.req_id), True) for r, _, _ in live]
        hidden = torch.stack([state[r.req_id][1] for r, _, _ in live])[None]
        h, logits, batch = self._run(chunks, hidden)
        for row, (r, _, _) in enumerate(live):
            state[r.req_id] = (logits[row], h[row])
        return logits


class DraftModelDrafter:
    """Drafts with a separate small model: its own cache tensors, the target's block tables."""

    def __init__(self, model: nn.Module, target: nn.Module, cfg, device: torch.device):
        from meshtron.config.fields import ConfigError
        from meshtron.inference.decode_attention import select_decode_attention

        if model.vocab_size != target.vocab_size:
            raise ConfigError(f"engine.speculative_model: the draft model's vocabulary ({model.vocab_size}) differs "
                              f"from the target's ({target.vocab_size}); use a draft trained with the same tokenizer")
        if MambaInferenceStateConfig.from_model(model) is not None:
            raise ConfigError("engine.speculative_model: the draft model has Mamba layers, whose state cannot be "
                              "rolled back past rejected drafts; use a draft without them")
        self.model = model.eval()
        self.cache = PagedKVCache(cfg.num_blocks, cfg.block_size, device)
        _, self.decode_attention = select_decode_attention(model, cfg, device)

    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        batch = build_varlen_batch(chunks, self.cache, None, self.decode_attention)
        logits = self.model(batch.tokens, batch.ctx)[0]  # (T, vocab)
        return logits[batch.sample_index]

    def catch_up(self, spec: SpeculativeDecoder, chunks: list[ScheduledChunk], valid: list[int],
                 sampled: dict[str, SampledToken], target_batch) -> None:
        """The draft model reads every token whose keys/values the target computed and keeps."""
        parts = [_chunk(c.req_id, c.token_ids[:v], c.start_pos, c.block_ids, False)
                 for c, v in zip(chunks, valid) if v]
        if parts:
            self._forward(parts)
        for req_id, token in sampled.items():
            if not token.error:
                spec.pending[req_id] = Pending()

    def start(self, spec, todo, kv) -> dict:
        return {}

    def step(self, spec, live, j: int, drafts: dict[str, list[int]], state: dict, kv) -> torch.Tensor:
        """Draft j (0-based): feed the request's last token (j = 0) or d_j at its position."""
        chunks = [_chunk(r.req_id, [drafts[r.req_id][-1] if j else r.output_token_ids[-1]], r.num_tokens - 1 + j,
                         kv.block_ids(r.req_id), True) for r, _, _ in live]
        return self._forward(chunks)


def kv_bytes_of_drafter(method: str, model: nn.Module, draft_model: Optional[nn.Module]) -> int:
    """Key/value bytes per token the drafter adds to the cache (for sizing it)."""
    from meshtron.inference.runner import kv_bytes_per_token

    if method == "mtp" and len(getattr(model, "mtp", ())):
        return kv_bytes_per_token(model.mtp[0])
    if method == "draft" and draft_model is not None:
        return kv_bytes_per_token(draft_model)
    return 0


def build_speculative(runner, model: nn.Module, cfg, device: torch.device,
                      draft_model: Optional[nn.Module]) -> Optional[SpeculativeDecoder]:
    """The runner's speculative decoder for cfg.speculative_method (None when it is 'none')."""
    from meshtron.config.fields import ConfigError

    if cfg.speculative_method == "none":
        return None
    if cfg.speculative_method == "mtp":
        drafter = MTPDrafter(model, runner.cache, runner.decode_attention)
    else:
        if draft_model is None:
            raise ConfigError("engine.speculative_model: speculative_method 'draft' needs a draft model; give its "
                              "checkpoint (--speculative-model DIR) or pass draft_model= to LLMEngine")
        drafter = DraftModelDrafter(draft_model, model, cfg, device)
    return SpeculativeDecoder(runner, drafter, cfg.num_speculative_tokens)
