"""The engine requests of one HTTP request, merged into one stream of (choice index, output), and the
server-sent events of a streaming answer. A client that goes away aborts its requests at once (their
KV blocks are freed); that is an ordinary event, logged in one line, never a traceback. A fault while
streaming ends the stream with an `error` event rather than a cut connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from meshtron.inference.engine import LLMEngine
from meshtron.inference.metrics import ServerMetrics
from meshtron.inference.outputs import RequestOutput
from meshtron.inference.protocol import error_body
from meshtron.inference.request import Request as EngineRequest

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

DISCONNECT_POLL_S = 0.25
# What the access log shows for an answer nobody received (nginx's "client closed request").
CLIENT_CLOSED = 499
logger = logging.getLogger("meshtron.server")


class Run:
    """Several engine requests of one HTTP request (n choices of each prompt, in order); stops early
    and aborts everything when the client goes away."""

    def __init__(self, engine: LLMEngine, requests: list[EngineRequest], http: Request, metrics: ServerMetrics,
                 n: int, response_id: str):
        self.engine, self.requests, self.http, self.metrics = engine, requests, http, metrics
        self.n, self.response_id = n, response_id
        self.final: list[Optional[RequestOutput]] = [None] * len(requests)
        self.client_left = False

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
                        self.client_left = True
                        logger.info("%s: the client went away; its %d request(s) are aborted", self.response_id,
                                    len(self.requests))
                        return
                if out is None:
                    continue
                if out.finished:
                    remaining -= 1
                    self.final[index] = out
                    self.metrics.finished_request(out, count_prompt=index % self.n == 0)
                yield index, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self) -> Optional[list[RequestOutput]]:
        """Every final output, or None when the client left (nobody reads this answer)."""
        async for _ in self.outputs():
            pass
        return None if self.client_left else self.final

    def failed(self, outputs: list[RequestOutput]) -> Optional[JSONResponse]:
        """An error answer when a request ended with an error: 503 when it was aborted (a drain that ran
        out of time), 500 when the engine failed it."""
        for out in outputs:
            if out.error:
                code = 503 if out.finish_reason == "abort" else 500
                self.metrics.error(code, "server_error")
                return JSONResponse(error_body(out.error, kind="server_error"), code,
                                    headers={"x-request-id": self.response_id})
        return None


def client_closed() -> Response:
    return Response(status_code=CLIENT_CLOSED)


class ClosingStreamingResponse(StreamingResponse):
    """Always closes the body iterator, so a stream cut by the client aborts its requests now
    rather than whenever the generator is garbage-collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse(chunks: AsyncIterator[dict], run: Run) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:  # a fault of ours after the 200 went out: say so in the stream
            logger.exception("%s: the stream failed", run.response_id)
            run.metrics.error(500, "server_error")
            yield f"data: {json.dumps(error_body(f'internal server error: {type(e).__name__}: {e}', kind='server_error'))}\n\n"
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    return ClosingStreamingResponse(events(), media_type="text/event-stream",
                                    headers={"x-request-id": run.response_id, "cache-control": "no-cache"})


def stream_error(run: Run, out: RequestOutput) -> Optional[dict[str, Any]]:
    """The `error` event after a choice that ended with an error (the openai client raises an APIError)."""
    if not (out.finished and out.error):
        return None
    run.metrics.error(503 if out.finish_reason == "abort" else 500, "server_error")
    return error_body(out.error, kind="server_error")
