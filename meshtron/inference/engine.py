"""LLMEngine: requests in, tokens out, through the scheduler, the KV cache manager and the runner.

`step()` is synchronous: schedule, one forward, sample, apply, detokenize, hand out outputs. Two
fronts use it:
- `generate(prompts, params)` steps until its requests finish (a script, `meshtron generate`);
- `stream(prompt, params)` is an async iterator. The first call starts a background thread that
  steps while there is work, so awaiting a stream never blocks the caller's event loop and works
  inside any running loop (a web server, a notebook). Requests and aborts from the loop reach the
  thread through an inbox; outputs come back with `loop.call_soon_threadsafe`.
Once that thread runs, `generate` hands its requests to it too and waits on a thread-safe queue
(never on an event loop), so it also works when called from inside a running loop.
A lock makes `step`, `suspend` and `resume` exclusive, so the fronts can be mixed; the loop hands it
over between steps (`HandoffLock`), so another thread never waits more than one step for it.
Faults stay with their request: one that fails while admitted, sampled or detokenized ends alone
with an error in its output. An error in the step itself fails the requests in flight; when the
engine cannot go on, `fatal_error` says why and every later request fails at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Optional, Union

import torch
from torch import nn

from meshtron.inference.config import EngineConfig
from meshtron.inference.kv_cache_manager import KVCacheManager
from meshtron.inference.mamba_state import MambaInferenceStateConfig, StateSlotPool
from meshtron.inference.memory_profile import size_kv_cache
from meshtron.inference.outputs import Detokenizer, RequestOutput
from meshtron.inference.request import InvalidRequestError, Request, RequestStatus, SamplingParams
from meshtron.inference.runner import ModelRunner, kv_bytes_per_token
from meshtron.inference.scheduler import Scheduler
from meshtron.inference.speculative import kv_bytes_of_drafter
from meshtron.models.blocks import SUBLAYERS

Prompt = Union[str, Sequence[int]]

log = logging.getLogger("meshtron.engine")

# The background loop gives up (sets `fatal_error`) after this many steps in a row raised.
MAX_CONSECUTIVE_STEP_FAILURES = 3


# Sublayers the engine can run (every symbol of models/blocks.SUBLAYERS today): attention keeps keys/values
# in the paged cache; Mamba keeps a recurrent state per request in a state slot (inference/mamba_state.py);
# the others keep nothing. A new symbol with state of its own needs the engine's support first.
SUPPORTED_SUBLAYERS = {s: kind.name for s, kind in SUBLAYERS.items()}


def check_supported(model: nn.Module) -> None:
    from meshtron.config.fields import ConfigError

    for layer in model.layers:
        symbol = getattr(layer, "symbol", "?")
        if symbol not in SUPPORTED_SUBLAYERS:
            raise ConfigError(f"model.layer_pattern: the inference engine has no cache for sublayer '{symbol}'; "
                              f"it runs {', '.join(f'{s!r} {n}' for s, n in SUPPORTED_SUBLAYERS.items())}")


class HandoffLock:
    """A re-entrant lock that the engine loop hands over between steps. CPython's locks are not fair:
    a loop that releases and at once re-acquires starves other threads (a server drain's
    `abort_all` waited out whole requests). Other threads count themselves in `waiting`; the loop
    calls `hand_over()` after each step and waits until they have had their turn."""

    def __init__(self):
        self._lock = threading.RLock()
        self._count = threading.Lock()
        self.waiting = 0

    def __enter__(self) -> HandoffLock:
        with self._count:
            self.waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self.waiting -= 1
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def hand_over(self) -> None:
        """Called without holding the lock: let every thread already waiting for it take it first."""
        while self.waiting:
            time.sleep(0.0005)


class LLMEngine:
    def __init__(self, model: nn.Module, tokenizer, config: Optional[EngineConfig] = None, *,
                 model_name: str = "meshtron", draft_model: Optional[nn.Module] = None):
        """draft_model: the drafter of engine.speculative_method draft (from_checkpoint loads
        engine.speculative_model)."""
        check_supported(model)
        self.tokenizer, self.model_name = tokenizer, model_name
        state_cfg = MambaInferenceStateConfig.from_model(model)
        self.device = next(model.parameters()).device
        if config is not None and config.quantize not in ("none", getattr(model, "quantization", "none")):
            from meshtron.inference.quantize import quantize_model

            quantize_model(model, config.quantize, self.device)  # in place, before the KV cache is sized
        # a null kv_cache_memory_mb: sized from free GPU memory after one profiled max-size step
        config = size_kv_cache(model, config or EngineConfig(), self.device, recurrent_state=state_cfg is not None)
        bytes_per_token = kv_bytes_per_token(model) + kv_bytes_of_drafter(config.speculative_method, model, draft_model)
        self.config = config.resolve(model.cfg.max_position_embeddings, bytes_per_token,
                                     recurrent_state=state_cfg is not None)
        self.vocab_size = model.vocab_size
        self.kv = KVCacheManager(self.config.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        slots = StateSlotPool(self.config.max_num_seqs) if state_cfg is not None else None
        self.scheduler = Scheduler(self.config, self.kv, slots)
        self.runner = ModelRunner(model, self.config, self.device, draft_model)
        self._detokenizers: dict[str, Detokenizer] = {}
        self._seeds: dict[str, int] = {}
        self._rng = random.Random(self.config.seed)
        self._ids = itertools.count()
        self._lock = HandoffLock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # req_id -> a callable that hands one output to whoever waits for it (any thread)
        self._streams: dict[str, Callable[[RequestOutput], None]] = {}
        self._suspended: Optional[list[tuple[Request, torch.Tensor]]] = None
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self._stopping = False
        self.fatal_error: Optional[str] = None  # set when the background loop cannot go on
        self.num_steps = 0
        # Called as hook(kind, payload) before each forward ("step", chunks), on suspend ("release")
        # and at shutdown ("stop"): tensor-parallel serving forwards these to the follower ranks.
        self.step_hook: Optional[Callable[..., None]] = None

    @classmethod
    def from_checkpoint(cls, path, config: Optional[EngineConfig] = None, *, tp_mesh=None,
                        model_name: Optional[str] = None) -> LLMEngine:
        """Build the model and tokenizer a checkpoint was trained with and load its weights.

        With `tp_mesh` the model is sharded with the training tensor-parallel plans first; every rank
        of the mesh then runs the same engine on the same requests (SPMD).
        """
        from meshtron.inference.loading import load_model_and_tokenizer

        config = config or EngineConfig()
        config.validate()
        model, tokenizer, name = load_model_and_tokenizer(path, config.device, tp_mesh, config.dtype, config.tokenizer)
        from meshtron.config.fields import ConfigError

        draft_model = None
        if config.speculative_method != "none" and tp_mesh is not None:
            raise ConfigError("engine.speculative_method: speculative decoding runs on one device; serve without "
                              "tensor parallelism or set speculative_method none")
        if config.speculative_method == "draft" and config.speculative_model is not None:
            draft_model, draft_tokenizer, _ = load_model_and_tokenizer(config.speculative_model, config.device, None,
                                                                       config.dtype, config.tokenizer)
            if draft_tokenizer.vocab_size != tokenizer.vocab_size:
                raise ConfigError(f"engine.speculative_model: its tokenizer has {draft_tokenizer.vocab_size} tokens, "
                                  f"the model's {tokenizer.vocab_size}; the draft must share the model's tokenizer")
        return cls(model, tokenizer, config, model_name=model_name or name, draft_model=draft_model)

    # ---- requests -------------------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                     req_id: Optional[str] = None) -> Request:
        """Tokenize and validate; raises InvalidRequestError (carrying the id) for bad input."""
        req_id = req_id or f"req-{next(self._ids)}"
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        params.validate(req_id, len(token_ids), self.config.max_model_len, self.vocab_size)
        if len(token_ids) + params.max_tokens > self.config.max_cached_tokens:
            raise InvalidRequestError(req_id, "max_tokens", f"prompt + max_tokens = {len(token_ids) + params.max_tokens} "
                                      f"tokens exceed the whole KV cache ({self.config.max_cached_tokens} tokens)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(req_id, "prompt", f"token ids {bad[:4]} outside the vocabulary [0, {self.vocab_size})")
        return Request(req_id, token_ids, params, eos_token_id=getattr(self.tokenizer, "eod_id", None))

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    req_id: Optional[str] = None) -> str:
        request = self.make_request(prompt, params, req_id)
        with self._lock:
            self._admit(request)
        return request.req_id

    def _admit(self, request: Request) -> None:
        if request.req_id in self.scheduler.requests or request.req_id in self._detokenizers:
            raise InvalidRequestError(request.req_id, "request_id", "a request with this id is already running")
        seed = request.sampling_params.seed
        seed = seed if seed is not None else self._rng.getrandbits(63)
        self.runner.add_request(request, seed)  # raises before registering
        self._seeds[request.req_id] = seed
        self._detokenizers[request.req_id] = Detokenizer(self.tokenizer, request.sampling_params.stop)
        self.scheduler.add_request(request)

    def abort(self, req_id: str, error: Optional[str] = None) -> bool:
        """Stop a request now and free its blocks; False if it is not running. `error` tells the
        request's client why (its final output carries it)."""
        with self._lock:
            request = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
            if request is None:
                return False
            request.error = error
            self._emit([self._finish_output(request)])
            return True

    def abort_all(self, error: str) -> int:
        """Abort every request, queued or running, with `error` (a drain that ran out of time); -> how many."""
        with self._lock:
            self._drain_inbox()
            req_ids = list(self.scheduler.requests)
            for req_id in req_ids:
                self.abort(req_id, error)
            return len(req_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or (self._suspended is not None and bool(self._suspended))

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and return the outputs of every request that changed."""
        with self._lock:
            self._drain_inbox()
            if self._suspended is not None:
                return []
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return []
            self.num_steps += 1
            if self.step_hook is not None:
                self.step_hook("step", sched.chunks)
            try:
                sampled = self.runner.execute(sched)
            except Exception as e:  # fail this step's requests, keep serving the others
                return self._emit([self._fail(c.req_id, f"the forward failed: {type(e).__name__}: {e}")
                                   for c in sched.chunks])
            for req_id, scored in self.runner.prompt_log_probs.items():
                self.scheduler.requests[req_id].prompt_log_probs.extend(scored)
            # a row that could not be sampled (non-finite logits) fails alone, before its token is applied
            failed = [self._fail(req_id, token.error) for req_id, token in sampled.items() if token.error]
            changed = self.scheduler.update_from_output(sched, sampled)
            outputs = self._emit(failed + self._outputs(changed))
            self.runner.propose_drafts(self.scheduler.requests, self.kv, self.config.max_model_len)
            return outputs

    def _outputs(self, changed: list[Request]) -> list[RequestOutput]:
        now, outputs = time.monotonic(), []
        for request in changed:
            try:
                outputs.append(self._output(request, now))
            except Exception as e:  # a request whose text cannot be made fails alone
                outputs.append(self._fail(request, f"detokenizing failed: {type(e).__name__}: {e}", decode=False))
        return outputs

    def _output(self, request: Request, now: float) -> RequestOutput:
        detok = self._detokenizers[request.req_id]
        if detok.update(request):
            self._cut_at_stop_string(request, detok)
            if not request.is_finished:
                self.scheduler.finish_request(request.req_id, RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            return self._finish_output(request, now)
        return detok.output(request, now)

    def _cut_at_stop_string(self, request: Request, detok: Detokenizer) -> None:
        """Speculative decoding appends several tokens in one step: keep only those up to the one that
        completed the stop string, as one token per step would have (the tokens after it are dropped)."""
        ids = request.output_token_ids
        for n in range(detok.num_sent_tokens + 1, len(ids)):
            text = self.tokenizer.decode(ids[:n])
            if any(stop in text for stop in detok.stop):
                was_finished = request.is_finished
                del ids[n:]
                del request.log_probs[n:]
                if was_finished:  # by a token now dropped: it stopped at the stop string instead
                    request.status = request.check_stop(self.config.max_model_len) or RequestStatus.FINISHED_STOPPED
                detok.update(request)
                return

    def _finish_output(self, request: Request, now: Optional[float] = None, decode: bool = True) -> RequestOutput:
        detok = self._detokenizers.pop(request.req_id, None)
        self.runner.remove_request(request.req_id)
        self._seeds.pop(request.req_id, None)
        if detok is None or not decode:
            detok = Detokenizer(self.tokenizer, ())  # no text (a fresh one decodes nothing)
        else:
            detok.update(request)  # the final text, cut at a stop string
        return detok.output(request, now or time.monotonic())

    def _fail(self, request: Union[str, Request], message: str, decode: bool = True) -> RequestOutput:
        """Finish a request (queued, running or just finished) as failed with `message` in its output."""
        req_id = request if isinstance(request, str) else request.req_id
        found = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_FAILED)
        request = found if found is not None else request
        assert isinstance(request, Request), f"{req_id} failed after it finished"
        request.status, request.error = RequestStatus.FINISHED_FAILED, message
        try:
            return self._finish_output(request, decode=decode)
        except Exception:  # the partial text could not be decoded either: report without it
            return self._finish_output(request, decode=False)

    def _emit(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            deliver = self._streams.get(out.req_id)
            if deliver is not None:
                try:
                    deliver(out)
                except RuntimeError:  # the stream's loop is closed: nobody is listening any more
                    self._streams.pop(out.req_id, None)
        return outputs

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and self.fatal_error is not None:
                self._reject(item, f"the engine is not running: {self.fatal_error}")
            elif kind == "add":
                try:
                    self._admit(item)
                except Exception as e:  # this request fails alone, whatever went wrong
                    message = str(e) if isinstance(e, InvalidRequestError) else f"admitting failed: {type(e).__name__}: {e}"
                    self._reject(item, message)
            else:
                self.abort(item)

    def _reject(self, request: Request, message: str) -> None:
        """Tell a request that never entered the scheduler that it failed."""
        request.status, request.error = RequestStatus.FINISHED_FAILED, message
        self._emit([Detokenizer(self.tokenizer, ()).output(request, time.monotonic())])

    # ---- synchronous front ----------------------------------------------------------------------

    def generate(self, prompts: Union[Prompt, list[Prompt]], params: Union[SamplingParams, list[SamplingParams], None] = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. Invalid input raises before anything runs."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params] * len(prompt_list)
        requests = [self.make_request(p, sp) for p, sp in zip(prompt_list, params_list)]
        if self._thread is not None:  # the background loop steps: wait for it like any stream
            return self._generate_via_loop(requests)
        with self._lock:
            for request in requests:
                self._admit(request)
            final: dict[str, RequestOutput] = {}
            while len(final) < len(requests):
                try:
                    outs = self.step()
                except Exception as e:  # leave the engine clean for the next call, then tell the caller
                    self._recover(f"the engine step failed: {type(e).__name__}: {e}")
                    raise
                for out in outs:
                    if out.finished:
                        final[out.req_id] = out
                if self._suspended is not None:
                    raise RuntimeError("the engine was suspended during generate(); resume() it first")
        return [final[r.req_id] for r in requests]

    def _generate_via_loop(self, requests: list[Request]) -> list[RequestOutput]:
        """Hand the requests to the background thread and block on a thread-safe queue until each
        has finished: no event loop is created or awaited, so a caller's running loop is fine."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        for request in requests:
            self._streams[request.req_id] = done.put
        final: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                self._submit(request)
            while len(final) < len(requests):
                out = done.get()
                if out.finished:
                    final[out.req_id] = out
        finally:
            for request in requests:
                if self._streams.pop(request.req_id, None) is not None and request.req_id not in final:
                    self._inbox.put(("abort", request.req_id))
            self._wake.set()
        return [final[r.req_id] for r in requests]

    # ---- asynchronous front ---------------------------------------------------------------------

    async def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                     req_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput each time the request gets tokens; the last has finished=True.
        Leaving the loop early (or cancelling the task) aborts the request and frees its blocks."""
        async for out in self.stream_request(self.make_request(prompt, params, req_id)):
            yield out

    async def stream_request(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream a request made (and validated) by `make_request`."""
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._streams[request.req_id] = lambda out: loop.call_soon_threadsafe(q.put_nowait, out)
        self._submit(request)
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request.req_id, None)
            if not finished:
                self._inbox.put(("abort", request.req_id))
                self._wake.set()

    def _submit(self, request: Request) -> None:
        """Hand a request to the background loop; once the engine has died it fails at once."""
        self._inbox.put(("add", request))
        if self.fatal_error is None:
            self.start_background_loop()
        if self.fatal_error is not None:  # also catches a request queued while the loop died
            with self._lock:
                self._drain_inbox()

    def start_background_loop(self) -> None:
        if self._thread is None and self.fatal_error is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run_loop, name="meshtron-engine", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run_loop(self) -> None:
        failures = 0
        try:
            while not self._stopping:
                if self._inbox.empty() and (self.scheduler.num_unfinished == 0 or self._suspended is not None):
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                try:
                    self.step()
                    failures = 0
                except Exception as e:
                    failures += 1
                    message = f"the engine step failed: {type(e).__name__}: {e}"
                    log.exception("%s (%d in a row)", message, failures)
                    if not self._recover(message) or failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        self._die(f"{message} ({failures} step(s) in a row); the engine stopped")
                        return
                self._lock.hand_over()
        except BaseException as e:  # never die silently: whoever waits is told
            self._die(f"the engine loop stopped: {type(e).__name__}: {e}")
            raise

    def _recover(self, message: str) -> bool:
        """After a step raised: fail every request in flight and check the cache is whole again;
        -> whether the engine can go on."""
        with self._lock:
            self._fail_in_flight(message)
            try:
                self.kv.reset()  # every block must be free now; the prefix cache may be stale
            except Exception:
                log.exception("the KV cache is inconsistent after a failed step")
                return False
            return True

    def _die(self, message: str) -> None:
        """The engine cannot go on: record why, fail everything in flight and everything queued."""
        with self._lock:
            self.fatal_error = message
            self._fail_in_flight(message)
            self._drain_inbox()  # rejects what is queued: the engine is not running
        log.error("%s", message)

    def _fail_in_flight(self, message: str) -> None:
        for req_id in list(self.scheduler.requests):
            try:
                self._emit([self._fail(req_id, message, decode=False)])
            except Exception:
                log.exception("failing %s", req_id)

    def shutdown(self, abort_running: bool = True) -> None:
        """Stop the background thread; abort what is still running (the server drains first)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        if abort_running:
            with self._lock:
                self._drain_inbox()
                for req_id in list(self.scheduler.requests):
                    self.abort(req_id)
        if self.step_hook is not None:
            self.step_hook("stop")

    # ---- suspend / resume -----------------------------------------------------------------------

    def suspend(self) -> None:
        """Free the KV cache and device buffers; in-flight requests are kept (with their sampling
        state) and re-added in arrival order by `resume()`, which recomputes their caches."""
        with self._lock:
            if self._suspended is not None:
                return
            self._drain_inbox()
            requests = self.scheduler.evict_all()
            self._suspended = [(r, self.runner.generator_state(r.req_id)) for r in requests]
            self.kv.reset()
            self.runner.release()
            if self.step_hook is not None:
                self.step_hook("release")

    def resume(self) -> None:
        with self._lock:
            if self._suspended is None:
                return
            later = list(self.scheduler.waiting)  # added while suspended
            self.scheduler.waiting.clear()
            for request, state in self._suspended:
                if request.is_finished:  # aborted while suspended
                    continue
                self.runner.add_request(request, self._seeds[request.req_id], state)
                if request.status == RequestStatus.RUNNING:
                    request.status = RequestStatus.PREEMPTED
                self.scheduler.waiting.append(request)
            for request in later:
                self.scheduler.waiting.append(request)
                if request.req_id not in self.runner.generators:
                    self.runner.add_request(request, self._seeds[request.req_id])
            self._suspended = None
        self._wake.set()

    @property
    def is_suspended(self) -> bool:
        return self._suspended is not None

    def stats(self) -> dict:
        stats = {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                 "num_free_blocks": self.kv.num_free_blocks, "num_blocks": self.config.num_blocks,
                 "num_steps": self.num_steps, "forwards": dict(self.runner.num_forwards)}
        if self.runner.speculative is not None:  # totals since the engine started (per request: RequestOutput)
            stats["speculative"] = {"method": self.config.speculative_method,
                                    "num_speculative_tokens": self.config.num_speculative_tokens,
                                    **self.runner.speculative.stats.as_dict()}
        return stats
