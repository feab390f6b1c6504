"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one `LLMEngine`.

Endpoints: /v1/completions and /v1/chat/completions (streaming as server-sent events), /v1/models,
/health and /v1/health (200 when ready; 503 while loading, draining or failed) and /v1/engine/stats
(meshtron's own: queue lengths and free KV blocks). Every response carries a request id (the
client's X-Request-Id header when given). Bad parameters are answered 400 with a message naming the
parameter. A client that disconnects aborts its requests, which frees their KV blocks at once.
SIGTERM starts a drain: /health and new requests answer 503 ("draining") while in-flight requests
run on for up to the drain timeout; what is left then is aborted, and its clients get an error
saying so (an SSE `error` event, or a 503 body); then the server closes its sockets and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from meshtron.inference.chat_template import render_chat
from meshtron.inference.engine import LLMEngine
from meshtron.inference.outputs import RequestOutput
from meshtron.inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_log_probs,
    completion_log_probs,
    envelope,
    error_body,
    finish_reason,
    usage,
)
from meshtron.inference.request import InvalidRequestError
from meshtron.inference.request import Request as EngineRequest

DISCONNECT_POLL_S = 0.25
DRAIN_POLL_S = 0.05
# After the drain, the time uvicorn gives open connections to write their last bytes.
FLUSH_TIMEOUT_S = 10.0


@dataclass
class ServerState:
    status: str = "loading"  # loading -> ready -> draining; or failed
    engine: Optional[LLMEngine] = None
    error: Optional[str] = None


class Unavailable(Exception):
    pass


class ClosingStreamingResponse(StreamingResponse):
    """Always closes the body iterator, so a stream cut by the client aborts its requests now
    rather than whenever the generator is garbage-collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def build_app(engine_factory: Callable[[], LLMEngine]) -> FastAPI:
    """The app; `engine_factory` runs in a thread at start-up so /health answers 503 meanwhile."""
    state = ServerState()

    def load() -> None:
        try:
            engine = engine_factory()
            engine.start_background_loop()
            state.engine, state.status = engine, "ready"
        except Exception as e:  # reported by /health; the process stays up to say why
            state.status, state.error = "failed", f"{type(e).__name__}: {e}"

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=load, name="meshtron-load", daemon=True).start()
        yield
        state.status = "draining"
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="meshtron", lifespan=lifespan)
    app.state.server = state
    _install_error_handlers(app)
    _install_info_routes(app, state)
    _install_completion_routes(app, state)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request body"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return JSONResponse(error_body(f"{param}: {first.get('msg')}" if param else first.get("msg"), param), 400)

    @app.exception_handler(InvalidRequestError)
    async def bad_params(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.param), 400)

    @app.exception_handler(Unavailable)
    async def unavailable(request: Request, exc: Unavailable) -> JSONResponse:
        return JSONResponse(error_body(str(exc), kind="service_unavailable"), 503)


def _install_info_routes(app: FastAPI, state: ServerState) -> None:
    async def health() -> JSONResponse:
        body = {"status": "ok" if state.status == "ready" else state.status}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, 200 if state.status == "ready" else 503)

    app.get("/health")(health)
    app.get("/v1/health")(health)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = _ready(state)
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "meshtron", "max_model_len": engine.config.max_model_len}]}

    @app.get("/v1/engine/stats")
    async def stats() -> dict[str, Any]:
        return _ready(state).stats()


def _ready(state: ServerState) -> LLMEngine:
    if state.status != "ready" or state.engine is None:
        raise Unavailable(f"the server is {state.status}" + (f": {state.error}" if state.error else ""))
    return state.engine


def _response_id(request: Request, prefix: str) -> str:
    return request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex[:24]}"


def _install_completion_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        engine = _ready(state)
        response_id = _response_id(request, "cmpl")
        body.unsupported(response_id)
        prompts = body.prompts()
        if not prompts:
            raise InvalidRequestError(response_id, "prompt", "no prompt given")
        requests, echoes = [], []
        for prompt in prompts:
            token_ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            for j in range(body.n):
                params = body.sampling_params(body.max_tokens, 16, j, body.logprobs is not None, body.logprobs or 0)
                requests.append(engine.make_request(token_ids, params, f"{response_id}-{len(requests)}"))
                echoes.append((prompt if isinstance(prompt, str) else engine.tokenizer.decode(token_ids))
                              if body.echo else "")
        run = _Run(engine, requests, request)
        if body.stream:
            return _sse(_completion_chunks(run, body, response_id, echoes), response_id)
        outputs = await run.collect()
        if (failed := _failed(outputs, response_id)) is not None:
            return failed
        choices = [{"index": i, "text": echoes[i] + o.text, "finish_reason": o.finish_reason,
                    "logprobs": completion_log_probs(engine.tokenizer, o.log_probs, len(echoes[i]),
                                                     body.return_tokens_as_token_ids)}
                   for i, o in enumerate(outputs)]
        return _json(envelope("text_completion", response_id, engine.model_name, choices,
                              {"usage": usage(outputs, body.n)}), response_id)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        engine = _ready(state)
        response_id = _response_id(request, "chatcmpl")
        body.unsupported(response_id)
        if not body.messages:
            raise InvalidRequestError(response_id, "messages", "no messages given")
        try:
            text, extra_stop = render_chat([m.model_dump() for m in body.messages],
                                           getattr(engine.tokenizer, "chat_template", None), engine.tokenizer)
        except Exception as e:  # a template that rejects the conversation
            raise InvalidRequestError(response_id, "messages", f"the chat template failed: {e}") from None
        token_ids = engine.tokenizer.encode(text)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        default_max = max(1, engine.config.max_model_len - len(token_ids))
        requests = []
        for j in range(body.n):
            params = body.sampling_params(max_tokens, default_max, j, body.logprobs, body.top_logprobs or 0)
            params.stop = params.stop + extra_stop
            requests.append(engine.make_request(token_ids, params, f"{response_id}-{j}"))
        run = _Run(engine, requests, request)
        if body.stream:
            return _sse(_chat_chunks(run, body, response_id), response_id)
        outputs = await run.collect()
        if (failed := _failed(outputs, response_id)) is not None:
            return failed
        choices = [{"index": i, "message": {"role": "assistant", "content": o.text}, "finish_reason": o.finish_reason,
                    "logprobs": chat_log_probs(engine.tokenizer, o.log_probs) if body.logprobs else None}
                   for i, o in enumerate(outputs)]
        return _json(envelope("chat.completion", response_id, engine.model_name, choices,
                              {"usage": usage(outputs, body.n)}), response_id)


class _Run:
    """Several engine requests of one HTTP request, merged into one stream of (choice index, output);
    stops early and aborts everything when the client goes away."""

    def __init__(self, engine: LLMEngine, requests: list[EngineRequest], http: Request):
        self.engine, self.requests, self.http = engine, requests, http
        self.final: list[Optional[RequestOutput]] = [None] * len(requests)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, request: EngineRequest) -> None:
            async for out in self.engine.stream_request(request):
                await merged.put((index, out))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.requests)]
        remaining, last_check = len(tasks), time.monotonic()
        try:
            while remaining:
                try:
                    index, out = await asyncio.wait_for(merged.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    index = out = None
                if time.monotonic() - last_check >= DISCONNECT_POLL_S:
                    last_check = time.monotonic()
                    if await self.http.is_disconnected():
                        return
                if out is None:
                    continue
                if out.finished:
                    remaining -= 1
                    self.final[index] = out
                yield index, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self) -> list[RequestOutput]:
        async for _ in self.outputs():
            pass
        if any(o is None for o in self.final):  # the client left; nobody reads this answer
            raise asyncio.CancelledError
        return self.final


def _failed(outputs: list[RequestOutput], response_id: str) -> Optional[JSONResponse]:
    """An error response when a request ended with an error: 503 when it was aborted (a drain that
    ran out of time), 500 when its forward failed."""
    for out in outputs:
        if out.error:
            code = 503 if out.finish_reason == "abort" else 500
            return JSONResponse(error_body(out.error, kind="server_error"), code, headers={"x-request-id": response_id})
    return None


def _json(body: dict, response_id: str) -> JSONResponse:
    return JSONResponse(body, headers={"x-request-id": response_id})


def _sse(chunks: AsyncIterator[dict], response_id: str) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await chunks.aclose()

    return ClosingStreamingResponse(events(), media_type="text/event-stream",
                                    headers={"x-request-id": response_id, "cache-control": "no-cache"})


async def _completion_chunks(run: _Run, body: CompletionRequest, response_id: str,
                             echoes: list[str]) -> AsyncIterator[dict]:
    engine, started = run.engine, set()
    outputs = run.outputs()
    try:
        async for index, out in outputs:
            text = out.new_text if index in started else echoes[index] + out.new_text
            started.add(index)
            offset = len(out.text) - len(out.new_text) + len(echoes[index])
            choice = {"index": index, "text": text, "finish_reason": finish_reason(out),
                      "logprobs": completion_log_probs(engine.tokenizer, out.new_log_probs, offset,
                                                       body.return_tokens_as_token_ids)}
            yield envelope("text_completion", response_id, engine.model_name, [choice])
            if out.finished and out.error:  # the openai client raises an APIError on this event
                yield error_body(out.error, kind="server_error")
    finally:
        await outputs.aclose()
    if body.include_usage():
        yield envelope("text_completion", response_id, engine.model_name, [], {"usage": usage(run.final, body.n)})


async def _chat_chunks(run: _Run, body: ChatCompletionRequest, response_id: str) -> AsyncIterator[dict]:
    engine, started = run.engine, set()
    outputs = run.outputs()
    try:
        async for index, out in outputs:
            delta: dict[str, Any] = {"content": out.new_text}
            if index not in started:
                started.add(index)
                delta["role"] = "assistant"
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason(out),
                      "logprobs": chat_log_probs(engine.tokenizer, out.new_log_probs) if body.logprobs else None}
            yield envelope("chat.completion.chunk", response_id, engine.model_name, [choice])
            if out.finished and out.error:  # the openai client raises an APIError on this event
                yield error_body(out.error, kind="server_error")
    finally:
        await outputs.aclose()
    if body.include_usage():
        yield envelope("chat.completion.chunk", response_id, engine.model_name, [], {"usage": usage(run.final, body.n)})


def drain_error(timeout_s: float) -> str:
    return (f"the server is shutting down and this request did not finish within the drain timeout "
            f"({timeout_s:g} s); it was aborted, retry it on another server")


async def drain(state: ServerState, timeout_s: float) -> int:
    """Answer 503 to /health and new requests, let in-flight requests finish for up to `timeout_s`,
    then abort what is left with a clear error (which frees its blocks); -> how many were aborted."""
    if state.status == "ready":
        state.status = "draining"
    engine = state.engine
    if engine is None:
        return 0
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if not engine.has_unfinished_requests():
        return 0
    return await asyncio.to_thread(engine.abort_all, drain_error(timeout_s))


def build_server(engine_factory: Callable[[], LLMEngine], host: str, port: int, drain_timeout_s: float = 30.0,
                 log_level: str = "info"):
    """The uvicorn server (with the drain) and the app's state; `serve` runs it."""
    import uvicorn

    app = build_app(engine_factory)
    state: ServerState = app.state.server

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.status == "ready":
                state.status = "draining"  # /health says 503 from the signal on
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            # the sockets stay open while draining, so probes and new requests get a 503, not a refusal
            await drain(state, drain_timeout_s)
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after shutting down; a completed drain exits 0 instead
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_TIMEOUT_S)
    return DrainingServer(config), state


def serve(engine_factory: Callable[[], LLMEngine], host: str, port: int, drain_timeout_s: float = 30.0,
          log_level: str = "info") -> int:
    """Run the server until SIGINT/SIGTERM; in-flight requests get `drain_timeout_s` to finish."""
    server, state = build_server(engine_factory, host, port, drain_timeout_s, log_level)
    server.run()
    return 1 if state.status == "failed" else 0
