"""The OpenAI-compatible wire format: strict parsing of request bodies, the request models (pydantic),
OpenAI-shaped errors, and the response/chunk dictionaries.

Standard fields follow the OpenAI API; `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`repetition_penalty`, `min_tokens`, `prompt_logprobs` (vLLM's names), `logprobs_mode` and (completions)
`return_tokens_as_token_ids` are extensions (the official client passes them through `extra_body`).
Types are strict (a float or a bool is not a token id, a string is not a number), numbers are finite,
and parameters meshtron does not implement are refused with a 400 naming them rather than silently
ignored (`IGNORED` lists the few that change nothing here). A null field means its default.
"""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, field_validator

from meshtron.inference.chat_template import message_text
from meshtron.inference.outputs import RequestOutput
from meshtron.inference.request import SamplingParams, TokenLogProbs
from meshtron.inference.server_logprobs import MIN_LOG_PROB, finite_log_prob, legacy_log_probs  # noqa: F401

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

# A JSON number (an integer is fine) that is finite; never a bool or a string.
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with HTTP `status`."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- parsing ----------------------------------------------------------------------------------------

def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a double; send a finite number")
    return value


def parse_body(raw: bytes) -> dict[str, Any]:
    """Bytes -> a JSON object, strictly: UTF-8, standard JSON (no NaN/Infinity), an object at the
    top, and no lone surrogates in any string (they cannot be encoded, so no tokenizer can take
    them). Raises ApiError(400) naming the problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start}); send JSON encoded as UTF-8",
                       code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                       code="invalid_json") from None
    except (ValueError, RecursionError) as e:  # NaN/Infinity, an overflowing number, an int of > 4300 digits, nesting
        reason = str(e) if isinstance(e, ValueError) else "it is nested too deeply"
        raise ApiError(400, f"the request body is not valid JSON: {reason}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_json")
    _refuse_surrogates(body)
    return body


def _refuse_surrogates(body: dict[str, Any]) -> None:
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:  # iterative: the depth is whatever json.loads accepted
        value, path = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if not k.isascii():
                    _check_text(k, path or "body")
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, str) and not value.isascii():
            _check_text(value, path)


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param}: a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start} is not "
                            "valid Unicode; send well-formed text", param) from None


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """The first pydantic error as a 400 naming the parameter (`messages[0].role`)."""
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    param = ""
    for part in first.get("loc", ()):
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    problem = _PROBLEMS.get(first.get("type", ""), first.get("msg", "is invalid"))
    return ApiError(400, f"{param}: {problem}" if param else problem, param or None)


_PROBLEMS = {
    "missing": "is required", "int_type": "must be an integer", "bool_type": "must be true or false",
    "float_type": "must be a number", "finite_number": "must be a finite number", "string_type": "must be a string",
    "list_type": "must be a list", "model_type": "must be an object", "dict_type": "must be an object",
    "extra_forbidden": "is not a supported field", "int_from_float": "must be an integer",
}


# ---- request models ---------------------------------------------------------------------------------

class _Strict(BaseModel):
    @field_validator("*", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info) -> Any:
        field = cls.model_fields[info.field_name]
        if value is None and not field.is_required():
            return field.get_default(call_default_factory=True)
        return value


class StreamOptions(_Strict):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(_Strict):
    model_config = ConfigDict(extra="allow")  # unknown fields are refused by name in `unsupported()`

    model: StrictStr = ""  # empty: the served model
    temperature: Number = 1.0
    top_p: Number = 1.0
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Any = ()  # a string or a list of strings (checked below), kept as a tuple
    seed: Optional[StrictInt] = None
    user: Optional[StrictStr] = None  # an end-user id for the provider's abuse monitoring: nothing to do here
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    logit_bias: dict[StrictStr, Number] = Field(default_factory=dict)  # {"token id": bias}, kept as {id: bias}
    min_tokens: StrictInt = 0
    prompt_logprobs: Optional[StrictInt] = None
    top_k: StrictInt = 0
    min_p: Number = 0.0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    logprobs_mode: StrictStr = "raw"  # meshtron: 'processed' reports log probs of the sampled (tempered) distribution

    # OpenAI fields that change nothing on this server, accepted and ignored: a processing tier
    # (service_tier), keeping the answer on the provider's side (store) and tags for it (metadata),
    # and parallel_tool_calls (tools themselves are refused, so it has nothing to apply to).
    IGNORED: ClassVar[tuple[str, ...]] = ("service_tier", "store", "metadata", "parallel_tool_calls")
    MAX_LOG_PROBS: ClassVar[int] = SamplingParams.MAX_TOP_LOG_PROBS
    # A positive logit is divided by the penalty: far below 1 it overflows float32 (1e-300 made every
    # such logit inf, a 500), far above it means nothing more; these bounds keep it a finite factor.
    REPETITION_PENALTY_RANGE: ClassVar[tuple[float, float]] = SamplingParams.REPETITION_PENALTY_RANGE

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list):
            for i, s in enumerate(value):
                if not isinstance(s, str):
                    raise ApiError(400, f"stop[{i}]: must be a string", f"stop[{i}]")
            return tuple(value)
        raise ApiError(400, "stop: must be a string or a list of strings", "stop")

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float]) -> dict[int, float]:
        """JSON keys are strings: OpenAI's logit_bias writes token ids as decimal strings ("50256")."""
        for key in value:
            if not (key.isascii() and key.isdigit() and len(key) <= 18):
                raise ApiError(400, f"logit_bias: the key {key[:40]!r} is not a token id; keys are token ids written "
                                    'as strings, e.g. {"50256": -100}', "logit_bias")
        return {int(k): float(v) for k, v in value.items()}

    def unsupported(self) -> None:
        """Refuse what meshtron cannot honour, each with its own message."""
        extra = sorted(k for k in (self.model_extra or {}) if k not in self.IGNORED)
        if extra:
            raise ApiError(400, f"{extra[0]}: is not a supported parameter", extra[0])
        self._check_count("prompt_logprobs", self.prompt_logprobs)
        low, high = self.REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ApiError(400, f"repetition_penalty: {self.repetition_penalty!r} is not allowed; must be in "
                                f"[{low:g}, {high:g}] (1 is off, above 1 discourages repeats)", "repetition_penalty")

    def _check_count(self, name: str, value: Optional[int]) -> None:
        if value is not None and not 0 <= value <= self.MAX_LOG_PROBS:
            raise ApiError(400, f"{name}: {value} is not allowed; must be an integer in [0, {self.MAX_LOG_PROBS}]",
                           name)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: Optional[int], default_max_tokens: int, index: int,
                        return_log_probs: bool, top_log_probs: int,
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """The engine's params for choice `index` (a seed is offset by the index so n > 1 differs);
        `prompt_logprobs` is what the engine scores of the prompt (an echo may need more than asked)."""
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            seed=None if self.seed is None else self.seed + index, stop_token_ids=tuple(self.stop_token_ids),
            stop=self.stop, ignore_eos=self.ignore_eos, return_log_probs=return_log_probs, top_log_probs=top_log_probs,
            logprobs_mode=self.logprobs_mode, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias), min_tokens=self.min_tokens, prompt_logprobs=prompt_logprobs)


def _is_token_id(x: Any) -> bool:
    return type(x) is int  # not a bool, not a float


class CompletionRequest(_Common):
    prompt: Any  # a string, a list of strings, a list of token ids or a list of lists of token ids
    max_tokens: Optional[StrictInt] = 16
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False  # vLLM's extension: logprobs tokens read "token_id:N"

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if value is None:
            raise ApiError(400, "prompt: is required", "prompt")
        if isinstance(value, str):
            return value
        shape = "must be a string, a list of strings, a list of token ids or a list of lists of token ids"
        if not isinstance(value, list):
            raise ApiError(400, f"prompt: {shape}", "prompt")
        if all(isinstance(x, str) for x in value) or all(_is_token_id(x) for x in value):
            return value
        for i, item in enumerate(value):
            if not isinstance(item, (str, list)) and not _is_token_id(item):
                raise ApiError(400, f"prompt[{i}]: a {type(item).__name__} is neither a string nor a token id "
                                    "(an integer)", f"prompt[{i}]")
        if not all(isinstance(x, list) for x in value):
            raise ApiError(400, f"prompt: {shape}, not a mix of them", "prompt")
        for i, item in enumerate(value):
            for j, token in enumerate(item):
                if not _is_token_id(token):
                    raise ApiError(400, f"prompt[{i}][{j}]: a {type(token).__name__} is not a token id (an integer)",
                                   f"prompt[{i}][{j}]")
        return value

    def prompts(self) -> list[Union[str, list[int]]]:
        """Each prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and _is_token_id(p[0])):
            return [p]
        return list(p)

    def unsupported(self) -> None:
        super().unsupported()
        self._check_count("logprobs", self.logprobs)
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ApiError(400, "max_tokens: 0 generates nothing, which is only useful with echo or prompt_logprobs "
                                "(to score the prompt); ask for at least 1 token", "max_tokens")

    def echo_log_probs(self) -> bool:
        """Whether the `logprobs` of each choice start with the prompt's tokens (OpenAI's legacy echo)."""
        return self.echo and self.logprobs is not None

    def scored_prompt_logprobs(self) -> Optional[int]:
        """The engine's prompt_logprobs: the alternatives `prompt_logprobs` asks for and those an echo
        shows (`logprobs`); 0 for an echo of max_tokens=0, which the engine runs as scoring."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if wanted:
            return max(wanted)
        return 0 if self.echo and self.max_tokens == 0 else None


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id ...: handed to the chat template
    role: StrictStr
    content: StrictStr = ""  # text parts are joined before validation (ChatCompletionRequest)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None

    @field_validator("messages", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        """Content given as parts becomes the joined text of its text parts; any other part is refused."""
        if not isinstance(value, list):
            return value
        out = []
        for i, message in enumerate(value):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                for j, part in enumerate(content):
                    where = f"messages[{i}].content[{j}]"
                    if not isinstance(part, dict) or part.get("type") != "text":
                        kind = part.get("type") if isinstance(part, dict) else None
                        raise ApiError(400, f"{where}.type: {kind!r} is not supported; this server takes text "
                                            "parts only ({\"type\": \"text\", \"text\": ...})", f"{where}.type")
                    if not isinstance(part.get("text"), str):
                        raise ApiError(400, f"{where}.text: must be a string", f"{where}.text")
                message = {**message, "content": message_text(content)}
            out.append(message)
        return out

    def unsupported(self) -> None:
        super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: logprobs must be true when top_logprobs is given", "top_logprobs")
        self._check_count("top_logprobs", self.top_logprobs)
        if self.requested_max_tokens() == 0 and self.prompt_logprobs is None:
            param = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
            raise ApiError(400, f"{param}: 0 generates nothing, which is only useful with prompt_logprobs (to score "
                                "the prompt); ask for at least 1 token", param)

    def requested_max_tokens(self) -> Optional[int]:
        """max_completion_tokens (OpenAI's current name) over max_tokens; None: up to the context length."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def openapi_body(model_cls: type[BaseModel]) -> dict[str, Any]:
    """The `requestBody` of a route's OpenAPI entry (the routes read their bodies themselves, strictly),
    with the model's $defs inlined so /docs can show it."""
    schema = model_cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


# ---- responses --------------------------------------------------------------------------------------

def usage(outputs: list[RequestOutput], n: int = 1) -> dict[str, Any]:
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
    with `as_token_ids`, so a client gets the exact ids, as vLLM's return_tokens_as_token_ids); an
    echo's prompt tokens come first through `server_logprobs.legacy_log_probs`."""
    return legacy_log_probs(tokenizer, items, offset, as_token_ids)


def chat_log_probs(tokenizer, items: list[TokenLogProbs]) -> Optional[dict[str, Any]]:
    if not items:
        return None

    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": finite_log_prob(value), "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**entry(lp.token_id, lp.log_prob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in items]}


def envelope(kind: str, response_id: str, model: str, choices: list[dict], extra: Optional[dict] = None) -> dict:
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            **(extra or {})}
