"""Continuous batching under a token budget: no prefill or decode phases, just tokens to compute.

Each step the scheduler walks the running requests in arrival order and gives each the tokens it
still needs (one for a decode, the rest of the prompt — or a budget-sized chunk of it — for a
prefill), then admits waiting requests first-come-first-served while budget, request slots and
KV blocks last. When a running request cannot get a block, the most recently arrived running
request is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed from its tokens later (the prefix cache often makes that cheap). The result is a plain
`SchedulerOutput`; `update_from_output` applies what the runner sampled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from meshtron.inference.config import EngineConfig
from meshtron.inference.kv_cache_manager import KVCacheManager
from meshtron.inference.mamba_state import StateSlotPool
from meshtron.inference.request import EventType, Request, RequestStatus, TokenLogProbs


@dataclass
class ScheduledChunk:
    """The tokens one request computes this step."""

    req_id: str
    token_ids: list[int]  # tokens at positions start_pos .. start_pos + len - 1
    start_pos: int  # tokens already in the cache
    block_ids: list[int]  # the request's whole block table
    samples: bool  # the chunk reaches the request's last token, so its next token is sampled
    state_slot: int = -1  # the request's Mamba state slot (models with Mamba layers), else -1
    num_draft_tokens: int = 0  # speculative decoding: the last this many tokens are drafts to verify


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {c.req_id: len(c.token_ids) for c in self.chunks}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledToken:
    token_id: int
    log_probs: Optional[TokenLogProbs] = None
    error: Optional[str] = None  # the row could not be sampled: its request fails alone, nothing is appended
    # speculative decoding: the drafts accepted before token_id (appended first) and their log probs
    accepted_draft_ids: list[int] = field(default_factory=list)
    accepted_log_probs: list[Optional[TokenLogProbs]] = field(default_factory=list)


def _num_new(request: Request, num_computed: int, budget: int) -> int:
    """Tokens to compute this step: all that remain, drafts included, when the budget holds them; else a
    budget-sized chunk that, for a request with drafts, stops before its last token (the drafts are
    verified in the same chunk as that token, never split off: 0 means nothing fits this step)."""
    remaining = request.num_tokens + len(request.spec_token_ids) - num_computed
    if remaining <= budget:
        return remaining
    if request.spec_token_ids:
        return min(budget, request.num_tokens - 1 - num_computed)
    return budget


def _max_cached(request: Request) -> Optional[int]:
    """A request that wants prompt log probs takes from the prefix cache only the tokens whose log
    probs it already has (after a preemption); the rest are computed so their logits exist."""
    if request.sampling_params.prompt_logprobs is None:
        return None
    return len(request.prompt_log_probs)


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager, state_slots: Optional[StateSlotPool] = None):
        """state_slots: for models with Mamba layers, one recurrent-state slot per running request."""
        self.cfg = cfg
        self.kv = kv
        self.state_slots = state_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.cfg.max_num_batched_tokens)
        if not out.preempted_req_ids:  # memory is short: let the running requests drain first
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = _num_new(request, request.num_computed_tokens, budget)
            if num_new <= 0:  # its drafts do not fit the budget left: verified next step
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()  # the latest arrival; always after `request` or `request` itself
                self._preempt(victim)
                out.preempted_req_ids.append(victim.req_id)
                if victim is request:
                    return budget
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            request = self.waiting[0]
            hit_ids, num_hit = self.kv.get_computed_blocks(request, _max_cached(request))
            num_new = request.num_tokens + len(request.spec_token_ids) - num_hit
            if num_new > budget:
                if not self.cfg.enable_chunked_prefill:
                    return
                num_new = _num_new(request, num_hit, budget)
                if num_new <= 0:
                    return
            if self.state_slots is not None and self.state_slots.num_free == 0:
                return
            if not self.kv.allocate_slots(request, num_new, hit_ids):
                return
            if self.state_slots is not None:
                self.state_slots.acquire(request.req_id)
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0 and request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            request.record(EventType.SCHEDULED)
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start, n = request.num_computed_tokens, request.num_tokens
        tokens = [request.token_at(j) if j < n else request.spec_token_ids[j - n] for j in range(start, start + num_new)]
        slot = self.state_slots.slot_of[request.req_id] if self.state_slots is not None else -1
        num_drafts = max(0, start + num_new - n)  # all of them or none (`_num_new`)
        return ScheduledChunk(request.req_id, tokens, start, list(self.kv.block_ids(request.req_id)),
                              samples=start + num_new == n + num_drafts, state_slot=slot, num_draft_tokens=num_drafts)

    def _release_state(self, request: Request) -> None:
        if self.state_slots is not None:
            self.state_slots.release(request.req_id)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request, finished=False)
        self._release_state(request)  # recomputed from its tokens later, from a zero state
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        request.record(EventType.PREEMPTED)
        self.waiting.appendleft(request)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[Request]:
        """Advance every scheduled request; append sampled tokens; finish those that stop.

        Returns the requests that got a token or finished, in schedule order.
        """
        changed = []
        for chunk in out.chunks:
            request = self.requests.get(chunk.req_id)
            if request is None or request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += len(chunk.token_ids) - chunk.num_draft_tokens
            if not chunk.samples:
                self.kv.cache_blocks(request)
                continue
            request.spec_token_ids = []  # verified now (or never, for a failed row)
            if request.sampling_params.max_tokens == 0:  # scoring only: the prompt's log probs are all it wanted
                self.kv.cache_blocks(request)
                self.finish_request(request.req_id, RequestStatus.FINISHED_LENGTH)
                changed.append(request)
                continue
            token = sampled[chunk.req_id]
            status = self._append(request, chunk, token)
            self.kv.cache_blocks(request)
            if status is not None:
                self.finish_request(request.req_id, status)
            elif chunk.num_draft_tokens:  # the rejected drafts' slots go back (the next drafts allocate anew)
                self.kv.trim(request.req_id, request.num_tokens)
            changed.append(request)
        return changed

    def _append(self, request: Request, chunk: ScheduledChunk, token: SampledToken) -> Optional[RequestStatus]:
        """Append the accepted drafts, then the sampled token, stopping at the first that finishes the
        request; -> the finished status or None."""
        emitted = [*zip(token.accepted_draft_ids, token.accepted_log_probs), (token.token_id, token.log_probs)]
        request.num_sampling_steps += 1
        request.num_draft_tokens += chunk.num_draft_tokens
        request.num_accepted_tokens += len(token.accepted_draft_ids)
        status = None
        for j, (token_id, log_probs) in enumerate(emitted):
            if j:  # the token before this one was an accepted draft: its keys/values are computed
                request.num_computed_tokens += 1
            request.output_token_ids.append(token_id)
            if log_probs is not None:
                request.log_probs.append(log_probs)
            status = request.check_stop(self.cfg.max_model_len)
            if status is not None:
                break
        return status

    def finish_request(self, req_id: str, status: RequestStatus) -> Optional[Request]:
        """Finish (stop, length, abort, fail) a request wherever it is and free its blocks."""
        request = self.requests.pop(req_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request, finished=True)
        self._release_state(request)
        request.status = status
        kind = {RequestStatus.FINISHED_ABORTED: EventType.ABORTED,
                RequestStatus.FINISHED_FAILED: EventType.FAILED}.get(status, EventType.FINISHED)
        request.record(kind)
        return request

    def evict_all(self) -> list[Request]:
        """Free every unfinished request's blocks and return them in arrival order (for suspend)."""
        requests = sorted([*self.running, *self.waiting], key=lambda r: r.arrival_index)
        for request in requests:
            self.kv.free(request, finished=True)
            self._release_state(request)
            request.num_computed_tokens = 0
        self.running.clear()
        self.waiting.clear()
        return requests
