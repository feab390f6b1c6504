"""How much one HTTP request may ask of the server: reading a body within its byte limit, and the
checks that bound the work of a request before anything is tokenized. A request over a limit of
`ServerConfig` is answered 413 (body size) or 400 naming the parameter and the limit's flag.
"""

from __future__ import annotations

from typing import Any

from meshtron.inference.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from meshtron.inference.server_config import ServerConfig

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (--max-body-bytes); send a smaller request",
                    kind="invalid_request_error", code="request_too_large")


async def read_body(request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit`: from Content-Length before
    reading, else (chunked) while reading, so an oversized body is never held whole."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ApiError(400, f"Content-Length {length!r} is not a number")
        if int(length) > limit:
            raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _need(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(400, f"{param}: {message}", param)


def check_list_lengths(data: Any, cfg: ServerConfig, max_model_len: int) -> None:
    """On the parsed JSON, before validation: a list longer than its limit is refused by its length
    alone (validating 100k stop strings first cost ~1 s of the interpreter per request)."""
    if not isinstance(data, dict):
        return
    for param, limit, flag in (("stop", cfg.max_stop, "--max-stop"),
                               ("stop_token_ids", cfg.max_stop_token_ids, "--max-stop-token-ids")):
        value = data.get(param)
        _need(not isinstance(value, list) or len(value) <= limit, param,
              f"{len(value) if isinstance(value, list) else 0} entries is more than {limit} ({flag})")
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt[:1]):  # token ids: one prompt
            _need(len(prompt) <= max_model_len, "prompt",
                  f"{len(prompt)} tokens exceed the context length {max_model_len}")
        else:
            _need(len(prompt) <= cfg.max_prompts, "prompt",
                  f"{len(prompt)} prompts is more than {cfg.max_prompts} (--max-prompts)")
    messages = data.get("messages")
    _need(not isinstance(messages, list) or len(messages) <= max_model_len, "messages",
          f"{len(messages) if isinstance(messages, list) else 0} messages cannot fit the context length {max_model_len}")


def check_common(body: CompletionRequest | ChatCompletionRequest, cfg: ServerConfig) -> None:
    _need(1 <= body.n <= cfg.max_n, "n", f"{body.n} is not allowed; must be in [1, {cfg.max_n}] (--max-n)")
    _need(len(body.stop) <= cfg.max_stop, "stop",
          f"{len(body.stop)} stop strings is more than {cfg.max_stop} (--max-stop)")
    for i, s in enumerate(body.stop):
        _need(len(s) <= cfg.max_stop_chars, f"stop[{i}]",
              f"{len(s)} characters is longer than {cfg.max_stop_chars} (--max-stop-chars)")
    _need(len(body.stop_token_ids) <= cfg.max_stop_token_ids, "stop_token_ids",
          f"{len(body.stop_token_ids)} ids is more than {cfg.max_stop_token_ids} (--max-stop-token-ids)")


def check_completion(body: CompletionRequest, prompts: list[Any], cfg: ServerConfig, max_model_len: int) -> None:
    """Bounds on the prompts before any is tokenized."""
    check_common(body, cfg)
    _need(bool(prompts), "prompt", "no prompt given")
    _need(len(prompts) <= cfg.max_prompts, "prompt",
          f"{len(prompts)} prompts is more than {cfg.max_prompts} (--max-prompts)")
    _need(len(prompts) * body.n <= cfg.max_choices, "n",
          f"{len(prompts)} prompts x n={body.n} is {len(prompts) * body.n} choices, more than {cfg.max_choices} "
          "(--max-choices); split the request")
    max_chars = max_model_len * cfg.max_chars_per_token
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            _need(len(p) <= max_chars, param, f"{len(p)} characters cannot fit the context length {max_model_len} "
                  f"(at most {cfg.max_chars_per_token} characters per token, --max-chars-per-token)")
        else:
            _need(len(p) <= max_model_len, param, f"{len(p)} tokens exceed the context length {max_model_len}")


def check_chat(body: ChatCompletionRequest, cfg: ServerConfig, max_model_len: int) -> None:
    check_common(body, cfg)
    _need(body.n <= cfg.max_choices, "n", f"{body.n} choices is more than {cfg.max_choices} (--max-choices)")
    _need(bool(body.messages), "messages", "no messages given")
    num_chars = sum(len(m.content) for m in body.messages)
    max_chars = max_model_len * cfg.max_chars_per_token
    _need(num_chars <= max_chars, "messages", f"{num_chars} characters of text cannot fit the context length "
          f"{max_model_len} (at most {cfg.max_chars_per_token} characters per token, --max-chars-per-token)")
