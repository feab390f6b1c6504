"""An engine worker of the data-parallel coordinator: a ZMQ DEALER that registers, takes requests,
steps its engine and sends responses back, answers control signals, and sends heartbeats.

The work itself is done by a handler: `EngineHandler` runs an engine (an `LLMEngine`, a tensor-parallel
leader's, any object with its request methods; payload `{"prompt": text or token ids, "sampling":
{SamplingParams fields}, "stream": bool}`, result `{"text", "token_ids", "log_probs",
"finish_reason", "prompt_token_ids", "output"}`, where `output` is the whole final output with the
top log probs and the prompt's log probs); `FunctionHandler` calls a plain function per payload
(tests, tools). A streamed request also sends its partial outputs after every step, as offsets
into its token ids, text and log probs (`output_delta`), so a client that saw part of a request
before its worker died can skip what the next worker sends again. PAUSE stops stepping (requests
keep queueing), UNPAUSE restarts it; SUSPEND / RESUME free and rebuild the engine's KV cache; STOP
acknowledges and leaves the loop; ABORT drops one request.

    python -m meshtron.inference.coordinator_worker --address tcp://127.0.0.1:5555 --checkpoint DIR \\
        --local-index 1   # serves on cuda:1 (default $LOCAL_RANK or 0)
"""

from __future__ import annotations

import argparse
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import zmq

from meshtron.inference.coordinator import pack, unpack

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


class RequestHandler(Protocol):
    def submit(self, req_id: str, payload: Any) -> None: ...

    def step(self) -> list[tuple[str, Any, Optional[str]]]: ...  # finished (req_id, result, error)

    def take_partials(self) -> list[dict]: ...  # streamed requests' outputs of the last step (OUTPUTS items)

    def abort(self, req_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def info(self) -> dict: ...  # sent with REGISTER

    def stats(self) -> dict: ...  # sent with each heartbeat

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

    def take_partials(self) -> list[dict]:
        return []

    def abort(self, req_id: str) -> None:
        self.queue = deque((r, p) for r, p in self.queue if r != req_id)

    def abort_all(self) -> None:
        self.queue.clear()

    def info(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {"num_waiting": len(self.queue)}

    def has_work(self) -> bool:
        return bool(self.queue)

    def suspend(self) -> None:
        pass

    def resume(self) -> None:
        pass


def pack_log_probs(items) -> list:
    """TokenLogProbs (None allowed: a prompt's first position) as msgpack-able lists."""
    return [None if lp is None else [lp.token_id, lp.log_prob, [list(t) for t in lp.top]] for lp in items]


def unpack_log_probs(items) -> list:
    from meshtron.inference.request import TokenLogProbs

    return [None if lp is None else TokenLogProbs(lp[0], lp[1], [tuple(t) for t in lp[2]]) for lp in items]


@dataclass
class _Sent:
    """How much of one streamed request went out: output tokens, text characters, log probs."""

    num_tokens: int = 0
    num_chars: int = 0
    num_log_probs: int = 0
    prompt_log_probs: bool = False


def output_delta(out, sent: _Sent) -> dict:
    """What `out` adds to what went out before (`sent`, advanced here), with the offsets it starts at."""
    delta = {"req_id": out.req_id, "num_output_tokens": len(out.token_ids),
             "token_offset": sent.num_tokens, "new_token_ids": list(out.token_ids[sent.num_tokens:]),
             "text_offset": sent.num_chars, "new_text": out.text[sent.num_chars:],
             "log_prob_offset": sent.num_log_probs, "new_log_probs": pack_log_probs(out.log_probs[sent.num_log_probs:]),
             "num_cached_tokens": out.num_cached_tokens}
    if out.prompt_log_probs is not None and not sent.prompt_log_probs:
        delta["prompt_log_probs"] = pack_log_probs(out.prompt_log_probs)
        sent.prompt_log_probs = True
    sent.num_tokens, sent.num_chars, sent.num_log_probs = len(out.token_ids), len(out.text), len(out.log_probs)
    return delta


class EngineHandler:
    """Runs generation requests on an engine (`LLMEngine` or one with its request methods)."""

    def __init__(self, engine):
        self.engine = engine
        self.early: list[tuple[str, Any, Optional[str]]] = []  # refused on arrival
        self.streams: dict[str, _Sent] = {}  # streamed requests in flight
        self.partials: list[dict] = []

    def submit(self, req_id: str, payload: Any) -> None:
        from meshtron.inference.request import InvalidRequestError, SamplingParams

        try:
            sampling = dict(payload.get("sampling") or {})
            for key in ("stop", "stop_token_ids"):
                if key in sampling:
                    sampling[key] = tuple(sampling[key])
            if isinstance(sampling.get("logit_bias"), dict):  # msgpack keeps int keys, JSON-ish callers send str
                sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
            self.engine.add_request(payload["prompt"], SamplingParams(**sampling), req_id)
        except (InvalidRequestError, TypeError, KeyError, ValueError) as e:
            self.early.append((req_id, None, f"{type(e).__name__}: {e}"))
            return
        if payload.get("stream"):
            self.streams[req_id] = _Sent()

    def step(self) -> list[tuple[str, Any, Optional[str]]]:
        done, self.early = self.early, []
        for out in self.engine.step():
            if out.finished:
                self.streams.pop(out.req_id, None)
                done.append((out.req_id, self.result(out), out.error))
            elif out.req_id in self.streams:
                self.partials.append(output_delta(out, self.streams[out.req_id]))
        return done

    @staticmethod
    def result(out) -> dict:
        """A finished request: RL's fields, and under `output` the whole output (offsets 0)."""
        return {"text": out.text, "token_ids": list(out.token_ids), "finish_reason": out.finish_reason,
                "log_probs": [lp.log_prob for lp in out.log_probs], "prompt_token_ids": list(out.prompt_token_ids),
                "output": output_delta(out, _Sent())}

    def take_partials(self) -> list[dict]:
        partials, self.partials = self.partials, []
        return partials

    def abort(self, req_id: str) -> None:
        self.streams.pop(req_id, None)
        self.early = [e for e in self.early if e[0] != req_id]
        self.engine.abort(req_id)

    def abort_all(self) -> None:
        self.streams.clear()
        self.early = []
        self.engine.abort_all("re-sent to another worker")

    def info(self) -> dict:
        cfg = self.engine.config
        return {"model_name": self.engine.model_name, "max_model_len": cfg.max_model_len,
                "max_cached_tokens": cfg.max_cached_tokens, "block_size": cfg.block_size,
                "num_blocks": cfg.num_blocks, "vocab_size": self.engine.vocab_size}

    def stats(self) -> dict:
        stats = self.engine.stats()
        return {k: stats[k] for k in ("num_running", "num_waiting", "num_free_blocks", "num_blocks", "num_steps")
                if k in stats}

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
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop an answer
        self.paused = False
        self.worker_id: Optional[int] = None

    def _send(self, message: dict) -> None:
        self.socket.send(pack(message))

    def _register(self) -> None:
        self.worker_id = None  # until REGISTERED: errors about messages sent before it are stale
        self._send({"type": "REGISTER", "name": self.name, "info": self.handler.info()})

    def run(self) -> None:
        """Register, then serve until STOP."""
        self.socket.connect(self.address)
        self._register()
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
                    finished = self.handler.step()
                    partials = self.handler.take_partials()  # before the finals: a stream's order
                    if partials:
                        self._send({"type": "OUTPUTS", "items": partials})
                    for req_id, result, error in finished:
                        self._send({"type": "RESPONSE", "req_id": req_id, "result": result, "error": error})
                if time.monotonic() - last_beat >= self.heartbeat_interval_s:
                    self._send({"type": "HEARTBEAT", "stats": self.handler.stats()})
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
        elif kind == "ABORT":
            self.handler.abort(msg["req_id"])
        elif kind == "ERROR" and msg.get("code") == "unknown_peer" and self.worker_id is not None:
            # dropped (silent too long): what it held was re-sent elsewhere; start afresh
            self.handler.abort_all()
            self._register()
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

    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m meshtron.inference.coordinator_worker",
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
