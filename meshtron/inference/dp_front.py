"""The engine the HTTP server talks to when data-parallel replicas serve: `ReplicaFront` has the
methods of `LLMEngine` the server calls (make_request, stream_request, abort_all, stats, shutdown),
and hands each request to the coordinator, which places it on a replica (router.py).

Requests are tokenized and checked here exactly as one engine would (the same `make_request`,
against the smallest limits of the registered replicas), so the HTTP answers, errors included, are
those of a single engine. Every request goes out streamed and seeded (a request without a seed
gets one here): a request re-sent after its replica died is generated again with the same tokens,
and the partial outputs already passed on are skipped by their offsets. One thread owns the ZMQ
socket; the server's threads hand it commands through a queue and a wake-up socket.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from meshtron.inference.coordinator import CoordinatorError, pack, unpack
from meshtron.inference.coordinator_worker import unpack_log_probs
from meshtron.inference.engine import LLMEngine
from meshtron.inference.outputs import RequestOutput
from meshtron.inference.request import Request, RequestStatus
from meshtron.inference.router import prefix_hashes

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

logger = logging.getLogger("meshtron.server")

POLL_MS = 100
STATS_EVERY_S = 1.0
ENGINE_STATS = ("num_running", "num_waiting", "num_free_blocks", "num_blocks", "num_steps")


@dataclass(frozen=True)
class ReplicaLimits:
    """The engine limits requests are checked against: the smallest of the registered replicas'."""

    max_model_len: int
    max_cached_tokens: int
    block_size: int


def _splice(have, offset: int, new):
    """`have` with everything from `offset` on replaced by `new` (None: a gap, `new` starts too late)."""
    return None if offset > len(have) else have[:offset] + new


@dataclass
class _Stream:
    """One request in flight: what its client got so far, rebuilt from the worker's offsets."""

    request: Request
    deliver: Callable[[RequestOutput], None]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    log_probs: list = field(default_factory=list)
    prompt_log_probs: Optional[list] = None
    num_cached_tokens: int = 0
    first_token_time: Optional[float] = None

    def apply(self, delta: dict, finished: bool = False, finish_reason: Optional[str] = None,
              error: Optional[str] = None) -> Optional[RequestOutput]:
        """The output that `delta` makes, or None when it brings nothing new (a re-sent request
        catching up) or cannot be placed (a lost message: the final answer carries everything)."""
        token_ids = _splice(self.token_ids, delta["token_offset"], list(delta["new_token_ids"]))
        text = _splice(self.text, delta["text_offset"], delta["new_text"])
        log_probs = _splice(self.log_probs, delta["log_prob_offset"], unpack_log_probs(delta["new_log_probs"]))
        if token_ids is None or text is None or log_probs is None:
            return None
        new_tokens, new_text, new_log_probs = token_ids[len(self.token_ids):], text[len(self.text):], \
            log_probs[len(self.log_probs):]
        if not (finished or new_tokens or new_text):
            return None
        if self.prompt_log_probs is None and delta.get("prompt_log_probs") is not None:
            self.prompt_log_probs = unpack_log_probs(delta["prompt_log_probs"])
        now = time.monotonic()
        if self.first_token_time is None and token_ids:
            self.first_token_time = now
        self.token_ids, self.text, self.log_probs = token_ids, text, log_probs
        self.num_cached_tokens = delta.get("num_cached_tokens", self.num_cached_tokens)
        return self.output(new_tokens, new_text, new_log_probs, finished, finish_reason, error, now)

    def output(self, new_tokens: list[int], new_text: str, new_log_probs: list, finished: bool,
               finish_reason: Optional[str], error: Optional[str], now: float) -> RequestOutput:
        return RequestOutput(
            req_id=self.request.req_id, prompt_token_ids=self.request.prompt_token_ids,
            token_ids=list(self.token_ids), new_token_ids=new_tokens, text=self.text, new_text=new_text,
            finished=finished, finish_reason=finish_reason if finished else None, log_probs=list(self.log_probs),
            new_log_probs=new_log_probs, num_cached_tokens=self.num_cached_tokens, error=error,
            arrival_time=self.request.arrival_time, first_token_time=self.first_token_time,
            finish_time=now if finished else None, prompt_log_probs=self.prompt_log_probs)

    def fail(self, error: str, finish_reason: str) -> RequestOutput:
        return self.output([], "", [], True, finish_reason, error, time.monotonic())


class ReplicaFront:
    """Requests to replicas behind the coordinator at `address`, as if to one engine."""

    make_request = LLMEngine.make_request  # the single engine's tokenizing and checks, on `config` below

    def __init__(self, address: str, tokenizer, *, model_name: Optional[str] = None, seed: Optional[int] = None,
                 timeout_s: float = 30.0):
        self.address, self.tokenizer, self.timeout_s = address, tokenizer, timeout_s
        self._model_name = model_name
        self.vocab_size: Optional[int] = None
        self.config: Optional[ReplicaLimits] = None
        self.replicas: dict[str, dict] = {}  # live replica name -> its engine info
        self.replica_stats: dict[str, dict] = {}  # from the coordinator's last STATS
        self.fatal_error: Optional[str] = None
        self.check: Optional[Callable[[], Optional[str]]] = None  # -> why the front cannot go on (dp_serving)
        self._ids = itertools.count()
        self._rng = random.Random(seed)
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._stopping = False
        context = zmq.Context.instance()
        self._socket = context.socket(zmq.DEALER)
        self._wake_in = context.socket(zmq.PULL)
        self._wake_out = context.socket(zmq.PUSH)
        self._wake_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    # ---- the engine's face ----------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        if self._model_name is not None:
            return self._model_name
        return next(iter(self.replicas.values()), {}).get("model_name", "meshtron")

    @property
    def live_replicas(self) -> int:
        return len(self.replicas)

    async def stream_request(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Like `LLMEngine.stream_request`: outputs until the last; leaving early aborts the request."""
        outputs: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._streams[request.req_id] = _Stream(request, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out))
        self._command("submit", request)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if self._streams.pop(request.req_id, None) is not None and not finished:
                self._command("abort", request.req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._streams)

    def abort_all(self, error: str) -> int:
        """End every request in flight with `error` (finish reason abort) and abort it on its replica."""
        streams = list(self._streams.values())
        for stream in streams:
            if self._streams.pop(stream.request.req_id, None) is not None:
                stream.deliver(stream.fail(error, RequestStatus.FINISHED_ABORTED.value))
                self._command("abort", stream.request.req_id)
        return len(streams)

    def stats(self) -> dict:
        """The replicas' engine counters added up, and each replica's own under `replicas`."""
        replicas = dict(self.replica_stats)
        total = {k: sum(r.get("engine", {}).get(k, 0) for r in replicas.values()) for k in ENGINE_STATS}
        return {**total, "num_replicas": len(self.replicas), "replicas": replicas}

    def start_background_loop(self) -> None:
        """Connect and start the socket's thread (once)."""
        if self._thread is not None:
            return
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)  # never drop a message: a dropped answer would hang its client
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.connect(self.address)
        self._socket.send(pack({"type": "HELLO", "watch": True}))
        wake = f"inproc://meshtron-front-{id(self)}"
        self._wake_in.bind(wake)
        self._wake_out.connect(wake)
        self._thread = threading.Thread(target=self._run, name="meshtron-dp-front", daemon=True)
        self._thread.start()

    def wait_for_replicas(self, count: int, timeout_s: float) -> None:
        """Block until `count` replicas are registered; raise CoordinatorError naming what is missing."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self.replicas) < count:
                reason = self.fatal_error or (self.check() if self.check is not None else None)
                if reason:
                    raise CoordinatorError(reason)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CoordinatorError(f"{len(self.replicas)} of {count} engine replicas registered at "
                                           f"{self.address} within {timeout_s:g} s")
                self._changed.wait(min(left, 0.5))

    def shutdown(self, abort_running: bool = True) -> None:
        if abort_running:
            self.abort_all("the server is shutting down")
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        for socket in (self._socket, self._wake_in, self._wake_out):
            socket.close(linger=0)

    # ---- the socket's thread --------------------------------------------------------------------

    def _command(self, kind: str, item: Any) -> None:
        self._commands.put((kind, item))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_out.closed:
                self._wake_out.send(b"", zmq.NOBLOCK)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        last_stats = 0.0
        try:
            while not self._stopping:
                events = dict(poller.poll(POLL_MS))
                if self._wake_in in events:
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                self._run_commands()
                if self._socket in events:
                    while self._socket.poll(0):
                        self._receive(unpack(self._socket.recv()))
                if time.monotonic() - last_stats >= STATS_EVERY_S:
                    self._socket.send(pack({"type": "STATS"}))
                    last_stats = time.monotonic()
                if self.check is not None and (reason := self.check()):
                    self._stop_for_good(reason)
                    return
        except Exception as e:  # never die silently: the server turns unhealthy and says why
            logger.exception("the data-parallel front failed")
            self._stop_for_good(f"the data-parallel front failed: {type(e).__name__}: {e}")

    def _stop_for_good(self, reason: str) -> None:
        self.fatal_error = reason
        self.abort_all(reason)
        with self._changed:
            self._changed.notify_all()

    def _run_commands(self) -> None:
        while True:
            try:
                kind, item = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._submit(item)
            else:
                self._socket.send(pack({"type": "ABORT", "req_id": item}))

    def _submit(self, request: Request) -> None:
        params = {k: v for k, v in vars(request.sampling_params).items() if not k.startswith("_")}
        if params["seed"] is None:  # a re-sent request must sample the same tokens again
            params["seed"] = self._rng.getrandbits(63)
        params["logit_bias"] = {str(k): v for k, v in params["logit_bias"].items()}  # msgpack maps want str keys
        cost = request.num_prompt_tokens + request.sampling_params.max_tokens
        route = {"cost": cost, "prefix": prefix_hashes(request.prompt_token_ids, self.config.block_size)}
        self._socket.send(pack({"type": "REQUEST", "req_id": request.req_id, "route": route,
                                "payload": {"prompt": request.prompt_token_ids, "sampling": params, "stream": True}}))

    def _receive(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind in ("WELCOME", "WORKERS"):
            self._set_replicas(msg.get("workers") or {})
        elif kind == "OUTPUTS":
            for item in msg["items"]:
                stream = self._streams.get(item["req_id"])
                out = stream.apply(item) if stream is not None else None
                if out is not None:
                    stream.deliver(out)
        elif kind == "RESPONSE":
            self._finish(msg)
        elif kind == "STATS":
            self.replica_stats = msg.get("workers") or {}
        elif kind == "ERROR":
            logger.error("the coordinator refused a message of the front: %s", msg.get("message"))

    def _finish(self, msg: dict) -> None:
        stream = self._streams.pop(msg["req_id"], None)
        if stream is None:
            return
        result, error = msg.get("result"), msg.get("error")
        out = None
        if result is not None:
            out = stream.apply(result["output"], True, result["finish_reason"], error)
        if out is None:  # no replica left to answer, or a worker that refused it
            lost = msg.get("worker") is None
            out = stream.fail(error or "the replica answered nothing", "abort" if lost else "error")
        stream.deliver(out)

    def _set_replicas(self, workers: dict[str, dict]) -> None:
        with self._changed:
            self.replicas = workers
            infos = [i for i in workers.values() if i]
            if infos:
                self.config = ReplicaLimits(min(i["max_model_len"] for i in infos),
                                            min(i["max_cached_tokens"] for i in infos),
                                            infos[0]["block_size"])
                self.vocab_size = infos[0]["vocab_size"]
            self._changed.notify_all()
