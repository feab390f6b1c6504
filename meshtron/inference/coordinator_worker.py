"""An engine worker of the data-parallel coordinator: a ZMQ DEALER that registers, takes requests,
steps its engine and sends responses back, answers control signals, and sends heartbeats.

The work itself is done by a handler: `EngineHandler` runs an `LLMEngine` (payload
`{"prompt": text or token ids, "sampling": {SamplingParams fields}}`, result `{"text", "token_ids",
"log_probs", "finish_reason"}`); `FunctionHandler` calls a plain function per payload (tests, tools).
PAUSE stops stepping (requests keep queueing), UNPAUSE restarts it; SUSPEND / RESUME free and rebuild
the engine's KV cache; STOP acknowledges and leaves the loop.

    python -m meshtron.inference.coordinator_worker --address tcp://127.0.0.1:5555 --checkpoint DIR \\
        --local-index 1   # serves on cuda:1 (default $LOCAL_RANK or 0)
"""

from __future__ import annotations

import argparse
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Optional, Protocol

import zmq

from meshtron.inference.coordinator import pack, unpack

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


class RequestHandler(Protocol):
    def submit(self, req_id: str, payload: Any) -> None: ...

    def step(self) -> list[tuple[str, Any, Optional[str]]]: ...  # finished (req_id, result, error)

    def has_work(self) -> bool: ...

    def suspend(self) -> None: ...

    def resume(self) -> None: ...


class FunctionHandler:
    """Answers each request with `fn(payload)`, one request per step, in arrival order."""

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn, self.queue = fn, deque()

    def submit(self, req_id: str, payload: Any) -> None:
        self.queue.append((req_id, payload))

    def step(self) -> list[tuple[str, Any, Optional[str]]]:
        if not self.queue:
            return []
        req_id, payload = self.queue.popleft()
        try:
            return [(req_id, self.fn(payload), None)]
        except Exception as e:
            return [(req_id, None, f"{type(e).__name__}: {e}")]

    def has_work(self) -> bool:
        return bool(self.queue)

    def suspend(self) -> None:
        pass

    def resume(self) -> None:
        pass


class EngineHandler:
    """Runs generation requests on an `LLMEngine`."""

    def __init__(self, engine):
        self.engine = engine
        self.early: list[tuple[str, Any, Optional[str]]] = []  # refused on arrival

    def submit(self, req_id: str, payload: Any) -> None:
        from meshtron.inference.request import InvalidRequestError, SamplingParams

        try:
            sampling = dict(payload.get("sampling") or {})
            for key in ("stop", "stop_token_ids"):
                if key in sampling:
                    sampling[key] = tuple(sampling[key])
            self.engine.add_request(payload["prompt"], SamplingParams(**sampling), req_id)
        except (InvalidRequestError, TypeError, KeyError) as e:
            self.early.append((req_id, None, f"{type(e).__name__}: {e}"))

    def step(self) -> list[tuple[str, Any, Optional[str]]]:
        done, self.early = self.early, []
        for out in self.engine.step():
            if out.finished:
                result = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "log_probs": [lp.log_prob for lp in out.log_probs], "prompt_token_ids": out.prompt_token_ids}
                done.append((out.req_id, result, out.error))
        return done

    def has_work(self) -> bool:
        return bool(self.early) or self.engine.has_unfinished_requests()

    def suspend(self) -> None:
        self.engine.suspend()

    def resume(self) -> None:
        self.engine.resume()


class EngineWorker:
    def __init__(self, address: str, handler: RequestHandler, name: Optional[str] = None,
                 heartbeat_interval_s: float = 0.5):
        self.address, self.handler = address, handler
        self.name = name or f"worker-{os.getpid()}"
        self.heartbeat_interval_s = heartbeat_interval_s
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.paused = False
        self.worker_id: Optional[int] = None

    def _send(self, message: dict) -> None:
        self.socket.send(pack(message))

    def run(self) -> None:
        """Register, then serve until STOP."""
        self.socket.connect(self.address)
        self._send({"type": "REGISTER", "name": self.name})
        last_beat = time.monotonic()
        try:
            while True:
                busy = self.handler.has_work() and not self.paused
                if self.socket.poll(0 if busy else 50):
                    while True:
                        try:
                            msg = unpack(self.socket.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        if not self._handle(msg):
                            return
                if not self.paused:
                    for req_id, result, error in self.handler.step():
                        self._send({"type": "RESPONSE", "req_id": req_id, "result": result, "error": error})
                if time.monotonic() - last_beat >= self.heartbeat_interval_s:
                    self._send({"type": "HEARTBEAT"})
                    last_beat = time.monotonic()
        finally:
            self.socket.close()

    def _handle(self, msg: dict) -> bool:
        """Apply one message; False when the worker must stop."""
        kind = msg.get("type")
        if kind == "REGISTERED":
            self.worker_id = msg["worker_id"]
        elif kind == "REQUEST":
            self.handler.submit(msg["req_id"], msg.get("payload"))
        elif kind == "CONTROL":
            signal = msg["signal"]
            if signal == "PAUSE":
                self.paused = True
            elif signal == "UNPAUSE":
                self.paused = False
            elif signal == "SUSPEND":
                self.handler.suspend()
            elif signal == "RESUME":
                self.handler.resume()
            if msg.get("token") is not None or signal == "STOP":
                self._send({"type": f"{signal}_ACK", "token": msg.get("token")})
            if signal == "STOP":
                return False
        return True


def worker_device_index(local_index: Optional[int], environ: dict, num_gpus: int) -> Optional[int]:
    """The GPU this worker serves on: `--local-index`, else $LOCAL_RANK (a launcher's per-host index),
    else 0; None without a GPU. Each worker of a host gets its own GPU (cuda:{local index})."""
    if num_gpus == 0:
        return None
    index = local_index if local_index is not None else int(environ.get("LOCAL_RANK", 0))
    if not 0 <= index < num_gpus:
        raise ValueError(f"--local-index: {index} but this process sees {num_gpus} GPU(s); give each worker of a "
                         f"host its own index in 0..{num_gpus - 1} (or set CUDA_VISIBLE_DEVICES to one GPU)")
    return index


def place_worker(local_index: Optional[int], device: str) -> Optional[int]:
    """Make the worker's GPU the current CUDA device (before the model is built), so `auto` and
    `cuda` mean cuda:{local index}; None on a CPU or with `--device cpu`."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return None
    index = worker_device_index(local_index, dict(os.environ), torch.cuda.device_count())
    torch.cuda.set_device(index)
    return index


def main(argv: Optional[list[str]] = None) -> int:
    from meshtron.inference.config import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser(prog="python -m meshtron.inference.coordinator_worker",
                                     description="Serve a checkpoint's engine behind a data-parallel coordinator.")
    parser.add_argument("--address", required=True, help="the coordinator's address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (a step dir or its parent)")
    parser.add_argument("--name", default=None, help="worker name in the coordinator's stats (default worker-PID)")
    parser.add_argument("--local-index", type=int, default=None,
                        help="this worker's index on its host: it serves on cuda:{index} (default $LOCAL_RANK or 0)")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    from meshtron.inference.engine import LLMEngine

    try:
        place_worker(args.local_index, args.device)
    except ValueError as e:
        parser.error(str(e))
    engine = LLMEngine.from_checkpoint(args.checkpoint, engine_config_from_args(args))
    EngineWorker(args.address, EngineHandler(engine), args.name).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
