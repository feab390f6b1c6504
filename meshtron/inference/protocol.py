"""The OpenAI-compatible wire format: request bodies (pydantic) and response/chunk dictionaries.

Standard fields follow the OpenAI API; `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`logprobs_mode` and (completions) `return_tokens_as_token_ids` are meshtron extensions (the official
client passes them through `extra_body`). Parameters meshtron does not implement are refused with a 400 naming them, rather than silently ignored.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from meshtron.inference.outputs import RequestOutput
from meshtron.inference.request import InvalidRequestError, SamplingParams, TokenLogProbs


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are checked by `unsupported()`

    model: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    logprobs_mode: str = "raw"  # meshtron: 'processed' reports log probs of the sampled (tempered) distribution

    IGNORED: ClassVar[tuple[str, ...]] = ("user", "logit_bias", "service_tier", "store", "metadata", "parallel_tool_calls")

    def unsupported(self, req_id: str) -> None:
        """Refuse what meshtron cannot honour, each with its own message."""
        if self.presence_penalty or self.frequency_penalty:
            name = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise InvalidRequestError(req_id, name, "penalties are not supported; leave it at 0")
        if not 1 <= self.n <= 16:
            raise InvalidRequestError(req_id, "n", f"{self.n} is not allowed; must be in [1, 16]")
        extra = sorted(k for k in (self.model_extra or {}) if k not in self.IGNORED)
        if extra:
            raise InvalidRequestError(req_id, extra[0], "is not a supported parameter")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling_params(self, max_tokens: Optional[int], default_max_tokens: int, index: int,
                        return_log_probs: bool, top_log_probs: int) -> SamplingParams:
        """The engine's params for choice `index` (a seed is offset by the index so n > 1 differs)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            seed=None if self.seed is None else self.seed + index, stop_token_ids=tuple(self.stop_token_ids),
            stop=stop, ignore_eos=self.ignore_eos, return_log_probs=return_log_probs, top_log_probs=top_log_probs,
            logprobs_mode=self.logprobs_mode)


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprobs tokens read "token_id:N"

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None


def usage(outputs: list[RequestOutput], n: int = 1) -> dict[str, int]:
    """Token counts; with n choices per prompt each prompt counts once (as OpenAI bills it)."""
    prompt = sum(o.num_prompt_tokens for o in outputs[::n])
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(out: RequestOutput) -> Optional[str]:
    return out.finish_reason if out.finished else None


def completion_log_probs(tokenizer, items: list[TokenLogProbs], offset: int,
                         as_token_ids: bool = False) -> Optional[dict[str, Any]]:
    """The legacy completions `logprobs` object for the tokens in `items` (tokens as "token_id:N"
    with `as_token_ids`, so a client gets the exact ids, as vLLM's return_tokens_as_token_ids)."""
    if not items:
        return None
    tokens = [f"token_id:{lp.token_id}" if as_token_ids else tokenizer.decode([lp.token_id]) for lp in items]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.log_prob for lp in items],
            "top_logprobs": [{tokenizer.decode([i]): v for i, v in lp.top} for lp in items], "text_offset": offsets}


def chat_log_probs(tokenizer, items: list[TokenLogProbs]) -> Optional[dict[str, Any]]:
    if not items:
        return None

    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.log_prob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in items]}


def envelope(kind: str, response_id: str, model: str, choices: list[dict], extra: Optional[dict] = None) -> dict:
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            **(extra or {})}


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
