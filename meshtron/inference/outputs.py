"""What the engine hands back: `RequestOutput` snapshots, and the incremental detokenizer that turns
a request's token ids into text, finds stop strings and decides how much text is safe to stream.

Streaming holds back two kinds of tail: an incomplete UTF-8 character (decoded as U+FFFD until its
last byte arrives) and, with stop strings, the last (longest stop - 1) characters, which might be
the start of a stop string. The token that stopped a request (eos or a stop token id) is kept in
`token_ids` but not rendered as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from meshtron.inference.request import Request, RequestEvent, RequestStatus, TokenLogProbs


@dataclass
class RequestOutput:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    new_token_ids: list[int]  # since the previous output of this request
    text: str  # all output text so far (cut at a stop string)
    new_text: str
    finished: bool
    finish_reason: Optional[str] = None  # stop, length, abort, error
    log_probs: list[TokenLogProbs] = field(default_factory=list)
    new_log_probs: list[TokenLogProbs] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: Optional[str] = None
    events: list[RequestEvent] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it)
    prompt_log_probs: Optional[list[Optional[TokenLogProbs]]] = None
    # speculative decoding (engine.speculative_method): drafts verified, drafts accepted, and the model
    # forwards that gave this request tokens; all 0 without it
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_sampling_steps: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def acceptance_rate(self) -> Optional[float]:
        """Accepted / verified drafts (None without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def tokens_per_step(self) -> Optional[float]:
        """Output tokens per model forward of this request: the speed-up over one token per forward."""
        return len(self.token_ids) / self.num_sampling_steps if self.num_sampling_steps else None


class Detokenizer:
    """Per-request text state for one request."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        self.num_sent_log_probs = 0
        self.first_token_time: Optional[float] = None

    def update(self, request: Request) -> bool:
        """Re-render the text; return True when a stop string was found (the text is cut before it)."""
        ids = request.output_token_ids
        if request.status == RequestStatus.FINISHED_STOPPED and ids and (
                ids[-1] == request.eos_token_id or ids[-1] in request.sampling_params.stop_token_ids):
            ids = ids[:-1]
        self.text = self.tokenizer.decode(ids) if ids else ""
        for stop in self.stop:
            at = self.text.find(stop)
            if at != -1:
                self.text = self.text[:at]
                return True
        return False

    def sendable(self, finished: bool) -> str:
        """The text that can be streamed now."""
        if finished:
            return self.text
        text = self.text.rstrip("\ufffd")
        return text[: max(self.num_sent_chars, len(text) - self.hold_back)]

    def output(self, request: Request, now: float) -> RequestOutput:
        """A snapshot of the request with everything new since the last snapshot."""
        finished = request.is_finished
        if self.first_token_time is None and request.output_token_ids:
            self.first_token_time = now
        text = self.sendable(finished)
        out = RequestOutput(
            req_id=request.req_id, prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids), new_token_ids=request.output_token_ids[self.num_sent_tokens:],
            text=text, new_text=text[self.num_sent_chars:], finished=finished, finish_reason=request.finish_reason,
            log_probs=list(request.log_probs), new_log_probs=request.log_probs[self.num_sent_log_probs:],
            num_cached_tokens=request.num_cached_tokens, error=request.error,
            prompt_log_probs=([None, *request.prompt_log_probs]
                              if request.sampling_params.prompt_logprobs is not None else None),
            events=list(request.events) if finished else [], arrival_time=request.arrival_time,
            first_token_time=self.first_token_time, finish_time=now if finished else None,
            num_draft_tokens=request.num_draft_tokens, num_accepted_tokens=request.num_accepted_tokens,
            num_sampling_steps=request.num_sampling_steps)
        self.num_sent_chars, self.num_sent_tokens = len(text), request.num_output_tokens
        self.num_sent_log_probs = len(request.log_probs)
        return out
