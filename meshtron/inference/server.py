"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one `LLMEngine`, or of several
engine replicas through `dp_front.ReplicaFront` (which the server talks to as to one engine; /health
then also reports the live replica count, and /metrics each replica's load).

Endpoints: /v1/completions and /v1/chat/completions (server_completions.py; streaming as server-sent
events), /v1/models, /health and /v1/health (200 when ready; 503 while loading, draining or failed),
/v1/engine/stats (queue lengths and free KV blocks) and /metrics (Prometheus). Requests are bounded
by `ServerConfig` (server_limits.py), errors answered in OpenAI's shape (server_errors.py), and with
an API key every route but the health checks needs it (server_auth.py). SIGTERM starts a drain:
/health and new requests answer 503 ("draining") while in-flight requests run on for up to the drain
timeout; what is left then is aborted with an error saying so. If the engine stops for good
(`engine.fatal_error`), /health answers 503 with the reason and the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from meshtron.inference.dp_metrics import replica_gauges
from meshtron.inference.engine import LLMEngine
from meshtron.inference.metrics import CONTENT_TYPE, ServerMetrics
from meshtron.inference.protocol import ApiError
from meshtron.inference.server_auth import BearerAuth
from meshtron.inference.server_completions import install_completion_routes
from meshtron.inference.server_config import ServerConfig
from meshtron.inference.server_errors import EchoRequestId, install_error_handlers, unauthorized
from meshtron.inference.server_streams import DISCONNECT_POLL_S, ClosingStreamingResponse  # noqa: F401 (public names)

DRAIN_POLL_S = 0.05
# How often the lifespan task looks at `engine.fatal_error`.
WATCH_POLL_S = 0.1
# After the drain, the time uvicorn gives open connections to write their last bytes.
FLUSH_TIMEOUT_S = 10.0
logger = logging.getLogger("meshtron.server")


class Unavailable(ApiError):
    """503: the server is loading, draining or failed."""

    def __init__(self, message: str):
        super().__init__(503, message, kind="service_unavailable")


@dataclass
class ServerState:
    status: str = "loading"  # loading -> ready -> draining; or failed
    engine: Optional[LLMEngine] = None
    error: Optional[str] = None
    config: ServerConfig = field(default_factory=ServerConfig)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    executor: Optional[ThreadPoolExecutor] = None  # parsing and tokenizing, off the event loop
    on_fatal: Optional[Callable[[], None]] = None  # asks uvicorn to exit (set by build_server)

    def ready(self) -> LLMEngine:
        if self.status != "ready" or self.engine is None:
            raise Unavailable(f"the server is {self.status}" + (f": {self.error}" if self.error else ""))
        return self.engine

    async def offload(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))


def fatal_error(engine: Optional[LLMEngine]) -> Optional[str]:
    return getattr(engine, "fatal_error", None) if engine is not None else None


async def watch_engine(state: ServerState) -> None:
    """Turn the server unhealthy, and ask it to exit, once the engine cannot go on."""
    while True:
        await asyncio.sleep(WATCH_POLL_S)
        reason = fatal_error(state.engine)
        if reason:
            state.status, state.error = "failed", f"the engine stopped: {reason}"
            logger.error("%s; the server exits", state.error)
            if state.on_fatal is not None:
                state.on_fatal()
            return


def build_app(engine_factory: Callable[[], LLMEngine], config: Optional[ServerConfig] = None,
              api_key: Optional[str] = None) -> FastAPI:
    """The app; `engine_factory` runs in a thread at start-up so /health answers 503 meanwhile."""
    state = ServerState(config=config or ServerConfig())
    state.config.validate()

    def load() -> None:
        try:
            engine = engine_factory()
            engine.start_background_loop()
            state.engine, state.status = engine, "ready"
        except Exception as e:  # reported by /health; the process stays up to say why
            state.status, state.error = "failed", f"{type(e).__name__}: {e}"

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.executor = ThreadPoolExecutor(state.config.tokenizer_threads, thread_name_prefix="meshtron-tokenize")
        threading.Thread(target=load, name="meshtron-load", daemon=True).start()
        watcher = asyncio.create_task(watch_engine(state))
        try:
            yield
        finally:
            watcher.cancel()
            if state.status != "failed":
                state.status = "draining"
            if state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown)
            state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="meshtron", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app, state.metrics)
    _install_info_routes(app, state)
    install_completion_routes(app, state)
    app.add_middleware(BearerAuth, api_key=api_key, refuse=lambda message: unauthorized(state.metrics, message))
    app.add_middleware(EchoRequestId)  # outermost of ours: a 401 also carries the client's id
    return app


def _install_info_routes(app: FastAPI, state: ServerState) -> None:
    async def health() -> JSONResponse:
        body = {"status": "ok" if state.status == "ready" else state.status}
        if state.error:
            body["error"] = state.error
        healthy = state.status == "ready"
        replicas = getattr(state.engine, "live_replicas", None)  # data-parallel replicas behind a front
        if replicas is not None:
            body["replicas"] = replicas
            if healthy and replicas == 0:  # requests wait for a replica to register meanwhile
                healthy, body["status"], body["error"] = False, "unavailable", "no engine replica is registered"
        return JSONResponse(body, 200 if healthy else 503)

    app.get("/health")(health)
    app.get("/v1/health")(health)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = state.ready()
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "meshtron", "max_model_len": engine.config.max_model_len}]}

    @app.get("/v1/engine/stats")
    async def stats() -> dict[str, Any]:
        return state.ready().stats()

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = state.engine.stats() if state.engine is not None else None
        if stats is not None and "replicas" in stats:
            replica_gauges(state.metrics.registry).update(stats)
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)


def drain_error(timeout_s: float) -> str:
    return (f"the server is shutting down and this request did not finish within the drain timeout "
            f"({timeout_s:g} s); it was aborted, retry it on another server")


async def drain(state: ServerState, timeout_s: float) -> int:
    """Answer 503 to /health and new requests, let in-flight requests finish for up to `timeout_s`,
    then abort what is left with a clear error (which frees its blocks); -> how many were aborted.
    An engine that stopped for good gets no time: its requests are failed at once."""
    if state.status == "ready":
        state.status = "draining"
    engine = state.engine
    if engine is None:
        return 0
    if state.status == "failed":
        return await asyncio.to_thread(engine.abort_all, state.error or "the engine stopped")
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if not engine.has_unfinished_requests():
        return 0
    return await asyncio.to_thread(engine.abort_all, drain_error(timeout_s))


def configure_logging(log_level: str) -> None:
    """uvicorn's log format on uvicorn's loggers and the server's own ("meshtron"), and nothing else.
    uvicorn's default (`logging.config.dictConfig`) would first close every handler the process ever
    made, which breaks a process that embeds the server (a test run, a notebook): their streams go too."""
    import sys

    from uvicorn.logging import AccessFormatter, DefaultFormatter

    default = logging.StreamHandler(sys.stderr)
    default.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    access = logging.StreamHandler(sys.stdout)
    access.setFormatter(AccessFormatter('%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'))
    for name, handler in (("uvicorn", default), ("uvicorn.access", access), ("meshtron", default)):
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, "meshtron_server", False)]:  # an earlier server's
            logger.removeHandler(old)
        handler.meshtron_server = True
        logger.addHandler(handler)
        logger.setLevel(log_level.upper())
        logger.propagate = False


def build_server(engine_factory: Callable[[], LLMEngine], host: str, port: int, drain_timeout_s: float = 30.0,
                 log_level: str = "info", config: Optional[ServerConfig] = None, api_key: Optional[str] = None):
    """The uvicorn server (with the drain) and the app's state; `serve` runs it."""
    import uvicorn

    app = build_app(engine_factory, config, api_key)
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

    configure_logging(log_level)
    config_ = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=None,
                             timeout_graceful_shutdown=FLUSH_TIMEOUT_S)
    server = DrainingServer(config_)
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    return server, state


def serve(engine_factory: Callable[[], LLMEngine], host: str, port: int, drain_timeout_s: float = 30.0,
          log_level: str = "info", config: Optional[ServerConfig] = None, api_key: Optional[str] = None) -> int:
    """Run the server until SIGINT/SIGTERM (-> 0), or until the engine stops for good (-> 1); in-flight
    requests get `drain_timeout_s` to finish."""
    server, state = build_server(engine_factory, host, port, drain_timeout_s, log_level, config, api_key)
    server.run()
    return 1 if state.status == "failed" else 0
