"""/v1/completions and /v1/chat/completions. The event loop only reads the body (within its byte
limit) and moves outputs; parsing, validation, chat-template rendering, tokenizing and the echo's
detokenizing run in the server's thread pool, so a large request never holds up the others. Engine
request ids are the server's own (`cmpl-<uuid>-<i>`); a client's X-Request-Id is logged only.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from meshtron.inference.chat_template import render_chat
from meshtron.inference.engine import LLMEngine
from meshtron.inference.outputs import RequestOutput
from meshtron.inference.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_log_probs,
    envelope,
    finish_reason,
    openapi_body,
    parse_body,
    usage,
)
from meshtron.inference.request import Request as EngineRequest
from meshtron.inference.server_config import ServerConfig
from meshtron.inference.server_limits import check_chat, check_completion, check_list_lengths, read_body
from meshtron.inference.server_logprobs import EchoedPrompt, TokenTexts, legacy_log_probs, prompt_log_probs
from meshtron.inference.server_streams import Run, client_closed, sse, stream_error

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

if TYPE_CHECKING:
    from meshtron.inference.server import ServerState

logger = logging.getLogger("meshtron.server")


def parse_request(model_cls, raw: bytes, served: str, cfg: Optional[ServerConfig] = None, max_model_len: int = 0):
    """Body bytes -> a validated request for the served model (404 for another model's name)."""
    data = parse_body(raw)
    if cfg is not None:  # long lists are refused by their length before the field-by-field validation
        check_list_lengths(data, cfg, max_model_len)
    model = data.get("model")
    if isinstance(model, str) and model and model != served:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{served}`", "model",
                       code="model_not_found")
    body = model_cls.model_validate(data)
    body.unsupported()
    return body


def encode(tokenizer, text: str, param: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except Exception as e:  # e.g. a special token a tokenizer refuses in plain text: the client's input
        raise ApiError(400, f"{param}: the tokenizer cannot encode it: {type(e).__name__}: {e}", param) from None


def prepare_completion(raw: bytes, engine: LLMEngine, cfg: ServerConfig, response_id: str
                       ) -> tuple[CompletionRequest, list[EngineRequest], list[str]]:
    """In the thread pool: the engine requests (n per prompt, in order) and each choice's echo."""
    body = parse_request(CompletionRequest, raw, engine.model_name, cfg, engine.config.max_model_len)
    prompts = body.prompts()
    check_completion(body, prompts, cfg, engine.config.max_model_len)
    requests, echoes = [], []
    scored = body.scored_prompt_logprobs()
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        token_ids = encode(engine.tokenizer, prompt, param) if isinstance(prompt, str) else list(prompt)
        for j in range(body.n):
            params = body.sampling_params(body.max_tokens, 16, j, body.logprobs is not None, body.logprobs or 0,
                                          scored)
            requests.append(engine.make_request(token_ids, params, f"{response_id}-{len(requests)}"))
        echo = (prompt if isinstance(prompt, str) else engine.tokenizer.decode(token_ids)) if body.echo else ""
        echoes.extend([echo] * body.n)
    return body, requests, echoes


def prepare_chat(raw: bytes, engine: LLMEngine, cfg: ServerConfig, response_id: str
                 ) -> tuple[ChatCompletionRequest, list[EngineRequest]]:
    body = parse_request(ChatCompletionRequest, raw, engine.model_name, cfg, engine.config.max_model_len)
    check_chat(body, cfg, engine.config.max_model_len)
    try:
        text, extra_stop = render_chat([m.model_dump() for m in body.messages],
                                       getattr(engine.tokenizer, "chat_template", None), engine.tokenizer)
    except Exception as e:  # a template that rejects the conversation
        raise ApiError(400, f"messages: the chat template failed: {e}", "messages") from None
    token_ids = encode(engine.tokenizer, text, "messages")
    default_max = max(1, engine.config.max_model_len - len(token_ids))
    requests = []
    for j in range(body.n):
        params = body.sampling_params(body.requested_max_tokens(), default_max, j, body.logprobs,
                                      body.top_logprobs or 0, body.prompt_logprobs)
        params.stop = params.stop + extra_stop
        requests.append(engine.make_request(token_ids, params, f"{response_id}-{j}"))
    return body, requests


def log_request(request: Request, response_id: str) -> None:
    client_id = request.headers.get("x-request-id")
    if client_id is not None:
        logger.info("%s %s: client request id %r", request.url.path, response_id, client_id[:200])


def install_completion_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        engine = state.ready()
        response_id = f"cmpl-{uuid.uuid4().hex}"
        log_request(request, response_id)
        raw = await read_body(request, state.config.max_body_bytes)
        body, requests, echoes = await state.offload(prepare_completion, raw, engine, state.config, response_id)
        run = Run(engine, requests, request, state.metrics, body.n, response_id)
        if body.stream:
            return sse(completion_chunks(run, body, echoes, state.offload), run)
        outputs = await run.collect()
        if outputs is None:
            return client_closed()
        if (failed := run.failed(outputs)) is not None:
            return failed
        choices = await state.offload(completion_choices, engine.tokenizer, body, outputs, echoes)
        return JSONResponse(envelope("text_completion", response_id, engine.model_name, choices,
                                     {"usage": usage(outputs, body.n)}), headers={"x-request-id": response_id})

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat(request: Request):
        engine = state.ready()
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        log_request(request, response_id)
        raw = await read_body(request, state.config.max_body_bytes)
        body, requests = await state.offload(prepare_chat, raw, engine, state.config, response_id)
        run = Run(engine, requests, request, state.metrics, body.n, response_id)
        if body.stream:
            return sse(chat_chunks(run, body, state.offload), run)
        outputs = await run.collect()
        if outputs is None:
            return client_closed()
        if (failed := run.failed(outputs)) is not None:
            return failed
        choices = [{"index": i, "message": {"role": "assistant", "content": o.text}, "finish_reason": o.finish_reason,
                    "logprobs": chat_log_probs(engine.tokenizer, o.log_probs) if body.logprobs else None}
                   for i, o in enumerate(outputs)]
        extra = await state.offload(chat_prompt_log_probs, engine.tokenizer, body, outputs[0])
        return JSONResponse(envelope("chat.completion", response_id, engine.model_name, choices,
                                     {"usage": usage(outputs, body.n), **extra}),
                            headers={"x-request-id": response_id})


def completion_choice(tokenizer, body: CompletionRequest, index: int, out: RequestOutput, echo: str,
                      stream_offset: Optional[int] = None, opening: bool = True) -> dict[str, Any]:
    """Choice `index` of a whole answer, or (with `stream_offset`, the text offset its next token
    gets) of one streamed chunk, where only the `opening` chunk of a choice carries the echo, the
    prompt's log probs and `prompt_logprobs`."""
    whole = stream_offset is None
    opening = whole or opening
    items = out.log_probs if whole else out.new_log_probs
    offset = len(echo) if whole else stream_offset
    logprobs = None
    if body.logprobs is not None:
        echoed = None
        if opening and body.echo_log_probs() and not out.error:
            echoed = EchoedPrompt(out.prompt_token_ids, out.prompt_log_probs, echo)
        logprobs = legacy_log_probs(tokenizer, items, offset, body.return_tokens_as_token_ids, echoed, body.logprobs)
    choice = {"index": index, "text": (echo if opening else "") + (out.text if whole else out.new_text),
              "finish_reason": finish_reason(out), "logprobs": logprobs}
    if body.prompt_logprobs is not None and opening and not out.error:
        choice["prompt_logprobs"] = prompt_log_probs(tokenizer, out.prompt_log_probs, body.prompt_logprobs)
    return choice


def completion_choices(tokenizer, body: CompletionRequest, outputs: list[RequestOutput],
                       echoes: list[str]) -> list[dict[str, Any]]:
    """In the thread pool: every choice of a whole answer (an echo's log probs cover the prompt)."""
    return [completion_choice(tokenizer, body, i, out, echoes[i]) for i, out in enumerate(outputs)]


def chat_prompt_log_probs(tokenizer, body: ChatCompletionRequest, out: RequestOutput) -> dict[str, Any]:
    """vLLM's top-level `prompt_logprobs` of a chat answer (every choice shares the prompt), if asked."""
    if body.prompt_logprobs is None or out.error:
        return {}
    return {"prompt_logprobs": prompt_log_probs(tokenizer, out.prompt_log_probs, body.prompt_logprobs)}


Offload = Callable[..., Awaitable[Any]]


async def completion_chunks(run: Run, body: CompletionRequest, echoes: list[str],
                            offload: Optional[Offload] = None) -> AsyncIterator[dict]:
    engine = run.engine
    texts = TokenTexts(engine.tokenizer)
    offsets: dict[int, int] = {}  # choice -> text offset of its next token: the token texts so far, added up
    heavy = body.echo_log_probs() or body.prompt_logprobs is not None  # a whole prompt's log probs
    outputs = run.outputs()
    try:
        async for index, out in outputs:
            opening = index not in offsets
            offset = offsets.get(index, len(echoes[index]))
            offsets[index] = offset + sum(len(texts(lp.token_id)) for lp in out.new_log_probs)
            args = (engine.tokenizer, body, index, out, echoes[index], offset, opening)
            choice = await offload(completion_choice, *args) if opening and heavy and offload else \
                completion_choice(*args)
            yield envelope("text_completion", run.response_id, engine.model_name, [choice])
            if (error := stream_error(run, out)) is not None:
                yield error
    finally:
        await outputs.aclose()
    if body.include_usage() and not run.client_left:
        yield envelope("text_completion", run.response_id, engine.model_name, [],
                       {"usage": usage(run.final, body.n)})


async def chat_chunks(run: Run, body: ChatCompletionRequest, offload: Optional[Offload] = None) -> AsyncIterator[dict]:
    engine, started = run.engine, set()
    outputs = run.outputs()
    try:
        async for index, out in outputs:
            delta: dict[str, Any] = {"content": out.new_text}
            extra: dict[str, Any] = {}
            if index not in started:
                if not started:  # the stream's first chunk carries the prompt's log probs, if asked
                    args = (engine.tokenizer, body, out)
                    extra = await offload(chat_prompt_log_probs, *args) if offload else chat_prompt_log_probs(*args)
                started.add(index)
                delta["role"] = "assistant"
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason(out),
                      "logprobs": chat_log_probs(engine.tokenizer, out.new_log_probs) if body.logprobs else None}
            yield envelope("chat.completion.chunk", run.response_id, engine.model_name, [choice], extra)
            if (error := stream_error(run, out)) is not None:
                yield error
    finally:
        await outputs.aclose()
    if body.include_usage() and not run.client_left:
        yield envelope("chat.completion.chunk", run.response_id, engine.model_name, [],
                       {"usage": usage(run.final, body.n)})
