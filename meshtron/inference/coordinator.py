"""The data-parallel coordinator: one ZMQ ROUTER socket in front of several engine workers.

Every message is a msgpack map with a `type`. Engine workers (`coordinator_worker.EngineWorker`)
connect with REGISTER {name, info} and send HEARTBEATs {stats}; clients (`CoordinatorClient`, the HTTP
front of `dp_front.py`) connect with HELLO {watch}. Then
    client REQUEST {req_id, payload, route} -> placed on a live worker by `router.Router`: the least
                                          outstanding tokens (route.cost, default 1, less the tokens
                                          it already generated), or the one that served the same
                                          prompt prefix (route.prefix) if within a margin of that
    worker OUTPUTS {items}             -> a streamed request's partial outputs, forwarded to its client
    worker RESPONSE {req_id, result | error} -> routed back to the client that asked
    client ABORT {req_id}              -> forgotten here and forwarded to its worker (no answer)
    client CONTROL {signal, token}     -> broadcast to every live worker; when all have answered
                                          `<signal>_ACK` the client gets one `<signal>_ACK` (a barrier)
A watching client also gets WORKERS {workers: name -> info} whenever a worker joins or leaves.
Signals are PAUSE / UNPAUSE (stop / restart stepping; requests still queue), SUSPEND / RESUME
(free / rebuild the KV cache) and STOP (the worker acknowledges and exits). A worker silent for
`heartbeat_timeout_s`, or one that acknowledged STOP, is dropped; its in-flight requests are re-sent
to the next live worker (which generates it again from the start: the HTTP front seeds every
request, so the tokens are the same), or, when none is left, answered with an error naming the
worker. Nothing is dropped silently. A request that arrives before any worker has registered waits
for one. A dropped worker that speaks again is told it is unknown, and registers anew.

`Coordinator(port=None)` binds a free port; `start()` runs it in a thread, `run()` in the caller.
`python -m meshtron.inference.coordinator [--host H] [--port P]` runs one in its own process.
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import zmq

from meshtron.inference.router import Router

SIGNALS = ("PAUSE", "UNPAUSE", "SUSPEND", "RESUME", "STOP")


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)


class CoordinatorError(RuntimeError):
    """The coordinator could not be reached or answered with an error."""


@dataclass
class _Worker:
    identity: bytes
    worker_id: int
    name: str
    last_seen: float
    in_flight: set[str] = field(default_factory=set)
    num_served: int = 0
    info: dict = field(default_factory=dict)  # what the worker serves (its engine's limits)
    stats: dict = field(default_factory=dict)  # its engine's queues and blocks, from its last heartbeat


@dataclass
class _Pending:
    client: bytes
    req_id: str
    payload: Any
    worker_id: Optional[int] = None
    attempts: int = 0
    cost: float = 1.0  # outstanding tokens when placed: prompt + max new tokens (1 without a route)
    prefix: list = field(default_factory=list)  # the prompt's leading block hashes (router.prefix_hashes)
    num_generated: int = 0  # tokens its worker reported so far (streamed requests)

    @property
    def outstanding(self) -> float:
        return max(self.cost - self.num_generated, 0)


@dataclass
class _Control:
    client: bytes
    signal: str
    token: Any
    waiting: set[int]


class Coordinator:
    def __init__(self, host: str = "127.0.0.1", port: Optional[int] = None, heartbeat_timeout_s: float = 5.0,
                 affinity_margin: float = 512):
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer raises instead of vanishing
        self.socket.setsockopt(zmq.SNDHWM, 0)  # no queue limit: a streamed answer's messages are never dropped
        self.socket.setsockopt(zmq.RCVHWM, 0)
        if port is None:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        else:
            self.socket.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.workers: dict[int, _Worker] = {}
        self.by_identity: dict[bytes, int] = {}
        self.clients: set[bytes] = set()
        self.watchers: set[bytes] = set()  # clients told of every worker that joins or leaves
        self.router = Router(affinity_margin)
        self.requests: dict[str, _Pending] = {}
        self.unassigned: deque[str] = deque()
        self.controls: list[_Control] = []
        self.state: list[str] = []  # PAUSE / SUSPEND in force, sent to workers that register later
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- running ------------------------------------------------------------------------------

    def start(self) -> Coordinator:
        self._thread = threading.Thread(target=self.run, name="meshtron-coordinator", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(50):
                    while True:
                        try:
                            identity, data = self.socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            msg = unpack(data)
                        except Exception:  # not msgpack: refused, the coordinator goes on
                            self._send(identity, {"type": "ERROR", "message": "a message that is not msgpack"})
                            continue
                        if isinstance(msg, dict):
                            self._handle(identity, msg)
                self._check_heartbeats()
        finally:
            self.socket.close(linger=0)

    # ---- messages -----------------------------------------------------------------------------

    def _send(self, identity: bytes, message: dict) -> bool:
        try:
            self.socket.send_multipart([identity, pack(message)], zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):  # peer gone (ROUTER_MANDATORY) or its queue full
            return False

    def _handle(self, identity: bytes, msg: dict) -> None:
        kind = msg.get("type")
        worker_id = self.by_identity.get(identity)
        if worker_id is not None:
            self.workers[worker_id].last_seen = time.monotonic()
        if kind == "REGISTER":
            self._register(identity, msg.get("name") or f"worker-{len(self.workers)}", msg.get("info") or {})
        elif kind == "HELLO":
            self.clients.add(identity)
            if msg.get("watch"):
                self.watchers.add(identity)
            self._send(identity, {"type": "WELCOME", "num_workers": len(self.workers), "address": self.address,
                                  "workers": self._roster()})
        elif worker_id is not None:
            self._from_worker(self.workers[worker_id], kind, msg)
        elif identity in self.clients:
            self._from_client(identity, kind, msg)
        else:  # also a worker dropped as silent that speaks again: it registers anew (coordinator_worker)
            self._send(identity, {"type": "ERROR", "code": "unknown_peer",
                                  "message": "unknown peer: send HELLO (client) or REGISTER (worker) first"})

    def _roster(self) -> dict[str, dict]:
        return {w.name: w.info for w in self.workers.values()}

    def _announce(self) -> None:
        for client in list(self.watchers):
            if not self._send(client, {"type": "WORKERS", "workers": self._roster()}):
                self.watchers.discard(client)

    def _register(self, identity: bytes, name: str, info: dict) -> None:
        old = self.by_identity.get(identity)
        if old is not None:
            self._drop_worker(old, "registered again")
        worker = _Worker(identity, next(self._ids), name, time.monotonic(), info=info)
        self.workers[worker.worker_id] = worker
        self.by_identity[identity] = worker.worker_id
        self._send(identity, {"type": "REGISTERED", "worker_id": worker.worker_id})
        for signal in self.state:
            self._send(identity, {"type": "CONTROL", "signal": signal, "token": None})
        self._announce()
        while self.unassigned:
            self._dispatch(self.unassigned.popleft())

    def _from_worker(self, worker: _Worker, kind: str, msg: dict) -> None:
        if kind == "RESPONSE":
            req_id = msg["req_id"]
            pending = self.requests.get(req_id)
            worker.in_flight.discard(req_id)
            if pending is None or pending.worker_id != worker.worker_id:
                return  # already answered by a worker it was re-sent to
            del self.requests[req_id]
            worker.num_served += 1
            self._send(pending.client, {"type": "RESPONSE", "req_id": req_id, "result": msg.get("result"),
                                        "error": msg.get("error"), "worker": worker.name})
        elif kind == "OUTPUTS":
            self._forward_outputs(worker, msg.get("items") or [])
        elif kind == "HEARTBEAT" and msg.get("stats") is not None:
            worker.stats = msg["stats"]
        elif kind is not None and kind.endswith("_ACK"):
            signal = kind[: -len("_ACK")]
            for control in list(self.controls):
                if control.signal == signal and worker.worker_id in control.waiting:
                    control.waiting.discard(worker.worker_id)
                    break
            if signal == "STOP":
                self._drop_worker(worker.worker_id, "stopped")
            self._finish_controls()

    def _forward_outputs(self, worker: _Worker, items: list[dict]) -> None:
        """Partial outputs to their clients, one message per client; each counts as progress."""
        by_client: dict[bytes, list[dict]] = {}
        for item in items:
            pending = self.requests.get(item.get("req_id"))
            if pending is None or pending.worker_id != worker.worker_id:
                continue  # aborted, or re-sent elsewhere
            pending.num_generated = max(pending.num_generated, int(item.get("num_output_tokens", 0)))
            by_client.setdefault(pending.client, []).append(item)
        for client, forwarded in by_client.items():
            self._send(client, {"type": "OUTPUTS", "items": forwarded, "worker": worker.name})

    def _from_client(self, client: bytes, kind: str, msg: dict) -> None:
        if kind == "REQUEST":
            req_id = str(msg.get("req_id") or uuid.uuid4().hex)
            if req_id in self.requests:
                self._send(client, {"type": "RESPONSE", "req_id": req_id, "result": None,
                                    "error": f"request id {req_id!r} is already in flight", "worker": None})
                return
            route = msg.get("route") or {}
            self.requests[req_id] = _Pending(client, req_id, msg.get("payload"), cost=float(route.get("cost", 1)),
                                             prefix=list(route.get("prefix") or []))
            self._dispatch(req_id)
        elif kind == "ABORT":
            self._abort(str(msg.get("req_id")))
        elif kind == "CONTROL":
            signal = msg.get("signal")
            if signal not in SIGNALS:
                self._send(client, {"type": "ERROR", "message": f"signal {signal!r}: choose one of {SIGNALS}"})
                return
            self._remember_state(signal)
            control = _Control(client, signal, msg.get("token"), set(self.workers))
            self.controls.append(control)
            for worker in list(self.workers.values()):
                if not self._send(worker.identity, {"type": "CONTROL", "signal": signal, "token": msg.get("token")}):
                    self._drop_worker(worker.worker_id, "unreachable")
            self._finish_controls()
        elif kind == "STATS":
            self._send(client, {"type": "STATS", "workers": {w.name: {"in_flight": len(w.in_flight),
                                                                       "served": w.num_served,
                                                                       "outstanding_tokens": self._load(w),
                                                                       "engine": w.stats}
                                                              for w in self.workers.values()},
                                 "in_flight": len(self.requests), "unassigned": len(self.unassigned),
                                 "state": list(self.state)})
        elif kind == "BYE":
            self.clients.discard(client)
            self.watchers.discard(client)
        else:
            self._send(client, {"type": "ERROR", "message": f"unknown message type {kind!r}"})

    def _remember_state(self, signal: str) -> None:
        undo = {"UNPAUSE": "PAUSE", "RESUME": "SUSPEND"}
        if signal in ("PAUSE", "SUSPEND") and signal not in self.state:
            self.state.append(signal)
        elif signal in undo and undo[signal] in self.state:
            self.state.remove(undo[signal])

    def _finish_controls(self) -> None:
        for control in list(self.controls):
            if not control.waiting:
                self.controls.remove(control)
                self._send(control.client, {"type": f"{control.signal}_ACK", "token": control.token,
                                            "num_workers": len(self.workers)})

    # ---- placement and failure ----------------------------------------------------------------

    def _load(self, worker: _Worker) -> float:
        """Outstanding tokens of the requests `worker` holds."""
        return sum(self.requests[r].outstanding for r in worker.in_flight if r in self.requests)

    def _dispatch(self, req_id: str) -> None:
        pending = self.requests[req_id]
        while True:
            choice = self.router.pick({w.worker_id: self._load(w) for w in self.workers.values()}, pending.prefix)
            if choice is None:
                self.unassigned.append(req_id)
                return
            worker = self.workers[choice]
            pending.worker_id, pending.attempts = worker.worker_id, pending.attempts + 1
            pending.num_generated = 0  # a worker it is re-sent to starts over
            if self._send(worker.identity, {"type": "REQUEST", "req_id": req_id, "payload": pending.payload}):
                worker.in_flight.add(req_id)
                return
            self._drop_worker(worker.worker_id, "unreachable")

    def _abort(self, req_id: str) -> None:
        pending = self.requests.pop(req_id, None)
        if pending is None:
            return
        worker = self.workers.get(pending.worker_id) if pending.worker_id is not None else None
        if worker is not None and req_id in worker.in_flight:
            worker.in_flight.discard(req_id)
            self._send(worker.identity, {"type": "ABORT", "req_id": req_id})
        elif req_id in self.unassigned:
            self.unassigned.remove(req_id)

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for worker in list(self.workers.values()):
            if now - worker.last_seen > self.heartbeat_timeout_s:
                self._drop_worker(worker.worker_id, f"silent for {now - worker.last_seen:.1f}s")

    def _drop_worker(self, worker_id: int, reason: str) -> None:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return
        self.by_identity.pop(worker.identity, None)
        self.router.forget(worker_id)
        self._announce()
        for control in self.controls:
            control.waiting.discard(worker_id)
        orphans = [r for r in worker.in_flight if r in self.requests]
        worker.in_flight.clear()
        for req_id in sorted(orphans):
            if self.workers:
                self._dispatch(req_id)
            else:
                pending = self.requests.pop(req_id)
                self._send(pending.client, {"type": "RESPONSE", "req_id": req_id, "result": None, "worker": None,
                                            "error": f"worker {worker.name} was lost ({reason}) with this request "
                                                     "in flight and no other worker is registered"})
        self._finish_controls()


@dataclass
class Response:
    req_id: str
    result: Any
    error: Optional[str]
    worker: Optional[str]


class CoordinatorClient:
    """A client of the coordinator: submit payloads, collect responses, broadcast control signals.
    Not thread-safe (one ZMQ socket): use one client per thread."""

    def __init__(self, address: str, timeout_s: float = 30.0):
        self.address, self.timeout_s = address, timeout_s
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.responses: dict[str, Response] = {}
        self._acks: list[dict] = []
        self._tokens = itertools.count()
        self.socket.send(pack({"type": "HELLO"}))
        welcome = self._receive_until(lambda m: m.get("type") == "WELCOME", timeout_s, "the handshake")
        self.num_workers = welcome["num_workers"]

    def _receive_until(self, done, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(int(left * 1000)):
                raise CoordinatorError(f"no answer from the coordinator at {self.address} within {timeout_s:.0f}s "
                                       f"({what})")
            msg = unpack(self.socket.recv())
            if msg.get("type") == "RESPONSE":
                self.responses[msg["req_id"]] = Response(msg["req_id"], msg.get("result"), msg.get("error"),
                                                         msg.get("worker"))
            elif msg.get("type") == "ERROR":
                raise CoordinatorError(msg["message"])
            if done(msg):
                return msg

    def submit(self, payload: Any, req_id: Optional[str] = None, route: Optional[dict] = None) -> str:
        """Send one request; `route` ({cost, prefix}) guides its placement (module docstring)."""
        req_id = req_id or uuid.uuid4().hex
        self.socket.send(pack({"type": "REQUEST", "req_id": req_id, "payload": payload, "route": route}))
        return req_id

    def abort(self, req_id: str) -> None:
        self.socket.send(pack({"type": "ABORT", "req_id": req_id}))

    def wait(self, req_ids: list[str], timeout_s: Optional[float] = None) -> list[Response]:
        """The responses to `req_ids`, in that order (blocking until all have arrived)."""
        missing = set(req_ids) - set(self.responses)
        if missing:
            self._receive_until(lambda m: m.get("type") == "RESPONSE" and not (missing - set(self.responses)),
                                timeout_s or self.timeout_s, f"{len(missing)} responses")
        return [self.responses.pop(r) for r in req_ids]

    def request_many(self, payloads: list[Any], timeout_s: Optional[float] = None) -> list[Response]:
        return self.wait([self.submit(p) for p in payloads], timeout_s)

    def control(self, signal: str, timeout_s: Optional[float] = None) -> dict:
        """Broadcast a signal and return the coordinator's `<signal>_ACK` once every worker has acknowledged."""
        token = next(self._tokens)
        self.socket.send(pack({"type": "CONTROL", "signal": signal, "token": token}))
        return self._receive_until(lambda m: m.get("type") == f"{signal}_ACK" and m.get("token") == token,
                                   timeout_s or self.timeout_s, f"{signal} acknowledgements")

    def stats(self) -> dict:
        self.socket.send(pack({"type": "STATS"}))
        return self._receive_until(lambda m: m.get("type") == "STATS", self.timeout_s, "stats")

    def close(self) -> None:
        try:
            self.socket.send(pack({"type": "BYE"}), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.socket.close(linger=0)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m meshtron.inference.coordinator",
                                     description="Run a data-parallel coordinator (ZMQ ROUTER) until interrupted.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port; default: a free one (printed)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds before a silent worker is dropped")
    parser.add_argument("--affinity-margin", type=float, default=512,
                        help="outstanding tokens by which a replica that served a prompt's prefix may exceed the "
                             "least loaded one and still get the request (default 512)")
    args = parser.parse_args(argv)
    coordinator = Coordinator(args.host, args.port, args.heartbeat_timeout, args.affinity_margin)
    print(coordinator.address, flush=True)
    try:
        coordinator.run()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
