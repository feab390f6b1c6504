"""One generation request: its token ids, progress, status, sampling parameters and lifecycle events.

A `Request` is the unit every part of the engine agrees on: the scheduler moves it between queues
and advances `num_computed_tokens`, the KV cache manager keys block tables by its `req_id`, the
runner reads its tokens, and the engine turns its outputs into results. `SamplingParams` are
checked once, on arrival; a bad value raises `InvalidRequestError` carrying the request id.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Optional


class InvalidRequestError(ValueError):
    """A request the engine refuses; `req_id` names it, `param` the offending field (HTTP 400)."""

    def __init__(self, req_id: str, param: str, message: str):
        super().__init__(f"request {req_id}: {param}: {message}")
        self.req_id, self.param, self.message = req_id, param, message


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to be recomputed from its tokens
    FINISHED_STOPPED = "stop"  # eos, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length reached
    FINISHED_ABORTED = "abort"
    FINISHED_FAILED = "error"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED


FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_FAILED)


class EventType(enum.Enum):
    ADDED = "added"
    SCHEDULED = "scheduled"  # first scheduled after arriving or after a preemption
    PREEMPTED = "preempted"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class RequestEvent:
    kind: EventType
    timestamp: float  # time.monotonic()


@dataclass
class SamplingParams:
    """How one request samples; every request in a batch may differ."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens whose probability is below min_p * the largest probability
    seed: Optional[int] = None  # a seeded request samples the same tokens whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the match
    ignore_eos: bool = False
    return_log_probs: bool = False
    top_log_probs: int = 0  # with return_log_probs: also the n most likely tokens at each step
    # 'raw': log probs of the model's distribution (OpenAI's convention); 'processed': of the
    # distribution actually sampled from (after temperature, top-k/p, min-p), as RL needs them
    logprobs_mode: str = "raw"
    # Penalties as vLLM defines them: presence/frequency subtract from the logit of every token
    # already generated (once, or once per occurrence); repetition divides a positive logit (and
    # multiplies a negative one) of every token seen in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # eos and stop token ids are masked until this many tokens were generated
    # vLLM's name: the log prob of every prompt token after the first and the k most likely tokens at
    # its position, from the prefill forward (None: off). With it, max_tokens=0 scores without generating.
    prompt_logprobs: Optional[int] = None

    MAX_TOP_LOG_PROBS = 20
    MAX_PENALTY = 2.0  # presence/frequency penalties in [-2, 2], as the OpenAI API
    MAX_LOGIT_BIAS = 100.0  # biases in [-100, 100], as the OpenAI API
    # Outside this a logit divided or multiplied by the penalty overflows float32 (1e-300 gave inf).
    REPETITION_PENALTY_RANGE = (0.01, 100.0)
    # Below this a temperature is refused (0 is greedy): sampling there is the argmax in all but name,
    # and far smaller values break the fp32 softmax (1e-300 is 0 in fp32: x / 0 gives inf and NaN).
    MIN_TEMPERATURE = 1e-3
    # torch.Generator.manual_seed's range; a request with n choices seeds choice i with seed + i.
    SEED_RANGE = (-(2**63), 2**64 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self, req_id: str, num_prompt_tokens: int, max_model_len: int, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        def need(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(req_id, param, message)

        need(num_prompt_tokens > 0, "prompt", "the prompt is empty; give at least one token")
        scoring = self.prompt_logprobs is not None
        need(_is_int(self.max_tokens) and self.max_tokens >= (0 if scoring else 1), "max_tokens",
             f"{self.max_tokens!r} is not allowed; must be an integer >= 1 (0 only with prompt_logprobs)")
        need(num_prompt_tokens + self.max_tokens <= max_model_len, "max_tokens",
             f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({self.max_tokens}) exceeds the context "
             f"length {max_model_len}; shorten the prompt or lower max_tokens")
        self._validate_numbers(need)
        need(self.logprobs_mode in ("raw", "processed"), "logprobs_mode",
             f"{self.logprobs_mode!r} is not allowed; choose raw or processed")
        need(_is_int(self.top_log_probs) and 0 <= self.top_log_probs <= self.MAX_TOP_LOG_PROBS, "top_log_probs",
             f"{self.top_log_probs!r} is not allowed; must be an integer in [0, {self.MAX_TOP_LOG_PROBS}]")
        need(not scoring or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= self.MAX_TOP_LOG_PROBS),
             "prompt_logprobs", f"{self.prompt_logprobs!r} is not allowed; must be an integer in "
             f"[0, {self.MAX_TOP_LOG_PROBS}] (the alternatives per position) or None")
        need(all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids", "token ids must be integers")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        need(not bad, "stop_token_ids", f"{bad[:4]} outside the vocabulary [0, {vocab_size})")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        self._validate_processors(need, vocab_size)
        low, high = self.SEED_RANGE
        need(self.seed is None or (_is_int(self.seed) and low <= self.seed <= high), "seed",
             f"{self.seed!r} is not allowed; must be an integer in [{low}, {high}] (with n > 1, seed + n - 1 too)")

    def _validate_numbers(self, need) -> None:
        t = self.temperature
        need(_is_number(t) and (t == 0 or self.MIN_TEMPERATURE <= t), "temperature",
             f"{t!r} is not allowed; must be 0 (greedy) or a finite number >= {self.MIN_TEMPERATURE}")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"{self.top_p!r} is not allowed; must be in (0, 1]")
        need(_is_int(self.top_k) and self.top_k >= 0, "top_k",
             f"{self.top_k!r} is not allowed; must be an integer >= 0 (0 keeps all)")
        need(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"{self.min_p!r} is not allowed; must be in [0, 1]")

    def _validate_processors(self, need, vocab_size: int) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(_is_number(value) and abs(value) <= self.MAX_PENALTY, name,
                 f"{value!r} is not allowed; must be in [-{self.MAX_PENALTY:g}, {self.MAX_PENALTY:g}]")
        low, high = self.REPETITION_PENALTY_RANGE
        need(_is_number(self.repetition_penalty) and low <= self.repetition_penalty <= high, "repetition_penalty",
             f"{self.repetition_penalty!r} is not allowed; must be in [{low:g}, {high:g}] (1 is off)")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"{self.min_tokens!r} is not allowed; must be an integer in [0, max_tokens]")
        need(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to numbers")
        for token, bias in self.logit_bias.items():
            need(_is_int(token) and 0 <= token < vocab_size, "logit_bias",
                 f"token id {token!r} is not in the vocabulary [0, {vocab_size})")
            need(_is_number(bias) and abs(bias) <= self.MAX_LOGIT_BIAS, "logit_bias",
                 f"bias {bias!r} for token {token} is not allowed; must be in [-100, 100]")


def _is_int(value) -> bool:
    """An int that is not a bool (True is an int in Python, never a count or a token id here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


@dataclass
class TokenLogProbs:
    """The chosen token's log probability and the top-n alternatives at one step."""

    token_id: int
    log_prob: float
    top: list[tuple[int, float]] = field(default_factory=list)


_ARRIVALS = itertools.count()


@dataclass(eq=False)  # requests compare by identity: two equal-looking requests are still two
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int] = None
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_index: int = field(default_factory=lambda: next(_ARRIVALS))  # FCFS order, never tied
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first scheduling
    num_preemptions: int = 0
    log_probs: list[TokenLogProbs] = field(default_factory=list)
    events: list[RequestEvent] = field(default_factory=list)
    error: Optional[str] = None
    prompt_log_probs: list[TokenLogProbs] = field(default_factory=list)  # prompt positions 1, 2, ... so far
    # speculative decoding: drafts for the positions after the last token (verified next step), and counts
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # drafts the target verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_sampling_steps: int = 0  # target forwards that gave this request tokens

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.record(EventType.ADDED)

    def record(self, kind: EventType) -> None:
        self.events.append(RequestEvent(kind, time.monotonic()))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> Optional[str]:
        """OpenAI's word for why it ended: 'stop', 'length', 'abort', 'error' (None while running)."""
        return self.status.value if self.is_finished else None

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def check_stop(self, max_model_len: int) -> Optional[RequestStatus]:
        """After a token was appended: the finished status it causes, or None to go on."""
        last = self.output_token_ids[-1]
        params = self.sampling_params
        if (not params.ignore_eos and last == self.eos_token_id) or last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
