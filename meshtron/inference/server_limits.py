"""How much one HTTP request may ask of the server: `ServerConfig` (each field a `meshtron serve`
flag), reading a body within its byte limit, and the checks that bound the work of a request before
anything is tokenized. A request over a limit is answered 413 (body size) or 400 naming the limit's
parameter and flag; the defaults are documented in docs/serving.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshtron.config.fields import ConfigError, option
from meshtron.inference.protocol import ApiError, ChatCompletionRequest, CompletionRequest


@dataclass(kw_only=True)
class ServerConfig:
    max_body_bytes: int = option(8 * 2**20, "Largest request body in bytes; a larger one is answered 413 before it "
                                            "is parsed (Content-Length, or counted while reading a chunked body)")
    max_prompts: int = option(256, "Most prompts in one /v1/completions request")
    max_n: int = option(16, "Largest n (choices per prompt)")
    max_choices: int = option(256, "Most choices in one request, prompts x n (each is one engine request)")
    max_stop: int = option(16, "Most stop strings in one request")
    max_stop_chars: int = option(256, "Longest stop string, in characters")
    max_stop_token_ids: int = option(64, "Most stop_token_ids in one request")
    max_chars_per_token: int = option(32, "A text prompt (or the messages' text) longer than max_model_len x this "
                                          "many characters is refused before it is tokenized")
    tokenizer_threads: int = option(4, "Threads that parse bodies, render chat templates, tokenize and detokenize "
                                       "echoes, off the event loop")

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{flag_name(f.name)}: {value!r} is not allowed; must be an integer >= 1")


def flag_name(field: str) -> str:
    return field.replace("_", "-")


def add_server_arguments(parser) -> None:
    """One flag per ServerConfig field (--max-body-bytes ...), help and default from the field."""
    group = parser.add_argument_group("request limits (docs/serving.md)")
    for f in dataclasses.fields(ServerConfig):
        group.add_argument("--" + flag_name(f.name), dest=f.name, type=int, default=f.default,
                           help=f"{f.metadata['help']} (default {f.default})")


def server_config_from_args(args) -> ServerConfig:
    cfg = ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
    cfg.validate()
    return cfg


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
    _need(bool(body.messages), "messages", "no messages given")
    num_chars = sum(len(m.content) for m in body.messages)
    max_chars = max_model_len * cfg.max_chars_per_token
    _need(num_chars <= max_chars, "messages", f"{num_chars} characters of text cannot fit the context length "
          f"{max_model_len} (at most {cfg.max_chars_per_token} characters per token, --max-chars-per-token)")
