"""Data-parallel serving: the router against hand-computed placements, the coordinator's load-based
placement, and the HTTP server in front of replicas (an in-process coordinator and engine-worker
threads) answering exactly as the server in front of one engine does: greedy, seeded sampling, log
probs, prompt log probs, streaming; a client that leaves aborts on its replica; a replica that stops
answering has its requests re-sent and /health counts it out. The slow test runs `meshtron serve
--dp 2` and kills a replica process with SIGKILL mid-request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshtron.inference.coordinator import Coordinator, CoordinatorClient
from meshtron.inference.coordinator_worker import EngineHandler, EngineWorker, FunctionHandler
from meshtron.inference.dp_front import ReplicaFront
from meshtron.inference.router import Router, prefix_hashes
from tests.inference.helpers import TOKENIZER, engine, tiny_model, wait_ready
from tests.inference.server_helpers import live_server

httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(num_blocks=64, block_size=4)


# ---- the router ---------------------------------------------------------------------------------------

def test_router_picks_the_least_outstanding_tokens_and_rotates_ties():
    router = Router(affinity_margin=0)
    assert router.pick({0: 300, 1: 120, 2: 450}) == 1
    assert router.pick({}) is None
    tied = Router()
    assert [tied.pick({0: 10, 1: 10, 2: 50}) for _ in range(4)] == [0, 1, 0, 1]


def test_prefix_hashes_cover_whole_leading_blocks():
    a = prefix_hashes(list(range(10)), 4)  # blocks [0..3], [4..7]; the last 2 tokens are no full block
    assert len(a) == 2 and all(len(h) == 8 for h in a)
    assert prefix_hashes(list(range(8)) + [99, 98], 4) == a
    changed = prefix_hashes([0, 1, 2, 3, 4, 5, 6, 70, 8, 9], 4)
    assert changed[0] == a[0] and changed[1] != a[1]  # a hash covers its block and everything before it
    assert prefix_hashes([5, 1, 2, 3, 4, 5, 6, 7], 4)[1] != a[1]
    assert len(prefix_hashes(list(range(100)), 4, max_blocks=3)) == 3
    assert prefix_hashes([1, 2, 3], 4) == []


def test_router_prefers_the_replica_that_served_the_prefix_within_the_margin():
    router = Router(affinity_margin=100)
    shared = list(range(16))
    p = prefix_hashes(shared + [1, 2, 3, 4], 4)  # 5 blocks: the 4 hashed
    q = prefix_hashes(shared[:8] + [9] * 12, 4)  # shares p's first 2 blocks only
    assert router.pick({0: 0, 1: 0}, p) == 0  # a tie: the first; 0 now owns p's prefixes
    assert router.pick({0: 90, 1: 0}, p) == 0  # 90 <= 0 + 100: the cache wins
    assert router.pick({0: 101, 1: 0}, p) == 1  # beyond the margin: the least loaded, which now owns p
    assert router.pick({0: 0, 1: 60}, p) == 1
    router.owner.clear()
    assert router.pick({0: 5, 1: 0}, q) == 1  # q's blocks go to 1 (least loaded)
    assert router.pick({0: 0, 1: 50}, p[:1] + p[1:2] + [b"x" * 8]) == 1  # the longest known prefix: q's 2 blocks
    router.forget(1)
    assert router.pick({0: 10, 2: 0}, q) == 2  # no owner left: the least loaded
    with pytest.raises(ValueError, match="affinity_margin"):
        Router(affinity_margin=-1)


# ---- the coordinator's placement --------------------------------------------------------------------

def worker_thread(address: str, handler, name: str) -> threading.Thread:
    thread = threading.Thread(target=EngineWorker(address, handler, name, heartbeat_interval_s=0.1).run,
                              name=f"test-{name}", daemon=True)
    thread.start()
    return thread


def wait_until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_coordinator_places_by_outstanding_tokens():
    """Paused workers answer nothing, so each placement sees every earlier one. Costs 100, 10, 10, 50,
    5, 30, 1 by least outstanding tokens: X=100; Y=10, 20, 70, 75, 105 (each below X's 100); then X=101.
    Round robin would have made 116 and 90."""
    coordinator = Coordinator(affinity_margin=0).start()
    client = CoordinatorClient(coordinator.address)
    try:
        for name in ("a", "b"):
            worker_thread(coordinator.address, FunctionHandler(lambda p: p), name)
        wait_until(lambda: len(client.stats()["workers"]) == 2, "2 workers")
        client.control("PAUSE")
        ids = [client.submit({"i": i}, route={"cost": c}) for i, c in enumerate((100, 10, 10, 50, 5, 30, 1))]
        wait_until(lambda: client.stats()["in_flight"] == 7, "7 placements")
        workers = client.stats()["workers"].values()
        assert sorted((w["outstanding_tokens"], w["in_flight"]) for w in workers) == [(101, 2), (105, 5)]
        client.control("UNPAUSE")
        assert [r.result["i"] for r in client.wait(ids)] == list(range(7))
        assert all(w["outstanding_tokens"] == 0 for w in client.stats()["workers"].values())
        client.control("STOP")
    finally:
        client.close()
        coordinator.close()


def test_a_worker_dropped_as_silent_registers_again():
    """Worker a spends 2.5 s on a request (no heartbeat), past the 1 s timeout: it is dropped and the
    request is answered by b; a's late answer is refused as from an unknown peer, and a registers anew."""
    coordinator = Coordinator(heartbeat_timeout_s=1.0).start()
    client = CoordinatorClient(coordinator.address)
    try:
        worker_thread(coordinator.address, FunctionHandler(lambda p: time.sleep(2.5) or "a"), "a")
        wait_until(lambda: len(client.stats()["workers"]) == 1, "a")
        worker_thread(coordinator.address, FunctionHandler(lambda p: "b"), "b")
        wait_until(lambda: len(client.stats()["workers"]) == 2, "b")
        (response,) = client.request_many([{"i": 0}], timeout_s=60)
        assert (response.result, response.worker) == ("b", "b")
        wait_until(lambda: len(client.stats()["workers"]) == 2, "a to register again")
        assert client.stats()["in_flight"] == 0
        assert not client.socket.poll(500)  # a's late answer was not passed on
        client.control("STOP")
    finally:
        client.close()
        coordinator.close()


def test_an_engine_worker_sends_prompt_log_probs_and_top_log_probs():
    """Through msgpack as on the wire: the finished result carries the prompt's log probs (the
    coordinator path used to drop them) and each token's top alternatives, as the engine made them."""
    from meshtron.inference.coordinator import pack, unpack
    from meshtron.inference.coordinator_worker import unpack_log_probs
    from meshtron.inference.request import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, return_log_probs=True, top_log_probs=2, prompt_logprobs=2)
    prompt = [5, 6, 7, 8, 9]
    handler = EngineHandler(engine(tiny_model(), **ENGINE))
    handler.submit("a", unpack(pack({"prompt": prompt, "sampling": vars(params)})))
    done = []
    while not done:
        done = handler.step()
    (req_id, result, error), = done
    result = unpack(pack(result))["output"]
    ref = engine(tiny_model(), **ENGINE).generate(prompt, params)[0]

    def rows(items):
        return [None if lp is None else (lp.token_id, round(lp.log_prob, 5), [(t, round(v, 5)) for t, v in lp.top])
                for lp in items]

    assert error is None and result["new_token_ids"] == ref.token_ids
    assert rows(unpack_log_probs(result["prompt_log_probs"])) == rows(ref.prompt_log_probs)
    assert rows(unpack_log_probs(result["new_log_probs"])) == rows(ref.log_probs)
    assert ref.prompt_log_probs[0] is None and len(ref.prompt_log_probs) == len(prompt)


# ---- the HTTP front of in-process replicas ------------------------------------------------------------

class DyingHandler(EngineHandler):
    """An engine handler whose worker stops dead (no answer, no heartbeat) once `die` is set."""

    def __init__(self, eng):
        super().__init__(eng)
        self.die = threading.Event()

    def step(self):
        if self.die.is_set():
            threading.Event().wait()  # forever: the thread is a daemon
        return super().step()


def slow(eng, step_s: float):
    eng.step_hook = lambda kind, *payload: time.sleep(step_s) if kind == "step" else None
    return eng


@contextlib.contextmanager
def replicas(num: int = 2, step_s: float = 0.0, heartbeat_timeout_s: float = 30.0):
    """-> (url, front, coordinator, handlers): the HTTP server before `num` engine-worker threads."""
    coordinator = Coordinator(heartbeat_timeout_s=heartbeat_timeout_s).start()
    handlers = [DyingHandler(slow(engine(tiny_model(), **ENGINE), step_s)) for _ in range(num)]
    for i, handler in enumerate(handlers):
        worker_thread(coordinator.address, handler, f"r{i}")
    front = ReplicaFront(coordinator.address, TOKENIZER, seed=0)
    front.start_background_loop()
    front.wait_for_replicas(num, 120)
    try:
        with live_server(front) as (url, _, _):
            yield url, front, coordinator, handlers
    finally:
        with contextlib.suppress(Exception):
            stopper = CoordinatorClient(coordinator.address, timeout_s=5)
            stopper.control("STOP", timeout_s=5)
            stopper.close()
        coordinator.close()


def answer(url: str, route: str, body: dict) -> dict:
    r = httpx.post(url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    # not usage's cached tokens: they depend on which replica's prefix cache saw what, and when
    usage = {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    return {"choices": data["choices"], "usage": usage, **{k: data[k] for k in ("prompt_logprobs",) if k in data}}


def same(a, b, tol: float = 1e-5) -> bool:
    """Equal JSON, log probs within `tol`: a batch of other shapes rounds the last float bits differently."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tol
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y, tol) for x, y in zip(a, b))
    return a == b


BODIES = [
    ("/v1/completions", {"prompt": "hello world, a greedy one", "max_tokens": 12, "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "seeded sampling", "max_tokens": 10, "temperature": 0.8, "seed": 7, "n": 2,
                         "logprobs": 1}),
    ("/v1/completions", {"prompt": "score this prompt", "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2,
                         "echo": True, "logprobs": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8,
                              "temperature": 0.7, "seed": 3, "logprobs": True, "top_logprobs": 2,
                              "prompt_logprobs": 1}),
    ("/v1/completions", {"prompt": "x" * 500, "max_tokens": 4}),  # refused: as one engine refuses it
]


def test_front_answers_as_one_engine():
    """Each body through the replicas equals the one-engine server's answer (greedy, seeded sampling,
    log probs, prompt log probs); several at once land on both replicas."""
    with live_server(engine(tiny_model(), **ENGINE)) as (url, _, _):
        expected = [answer(url, route, body) if i < 4 else httpx.post(url + route, json=body).json()
                    for i, (route, body) in enumerate(BODIES)]
        prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(8)]
        alone = [answer(url, "/v1/completions", {"prompt": p, "max_tokens": 16, "temperature": 0})["choices"]
                 for p in prompts]
    with replicas() as (url, front, coordinator, handlers):
        got = [answer(url, route, body) if i < 4 else httpx.post(url + route, json=body).json()
               for i, (route, body) in enumerate(BODIES)]

        async def together():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                rs = await asyncio.gather(*[c.post("/v1/completions", json={"prompt": p, "max_tokens": 16,
                                                                           "temperature": 0}) for p in prompts])
            return [r.json()["choices"] for r in rs]

        concurrent = asyncio.run(together())
        served = [h.engine.num_steps for h in handlers]
        health = httpx.get(url + "/health").json()
    assert same(got, expected), (got, expected)
    assert "prompt_logprobs" in got[2]["choices"][0] and "prompt_logprobs" in got[3]
    assert same(concurrent, alone)  # (usage's cached tokens differ: each replica has its own prefix cache)
    assert all(n > 0 for n in served)  # both replicas did work
    assert health == {"status": "ok", "replicas": 2}


def stream_events(url: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[5:]) for line in lines[:-1]]


def test_streaming_through_the_front_matches_the_whole_answer():
    body = {"prompt": "stream me", "max_tokens": 14, "temperature": 0.9, "seed": 5, "logprobs": 1}
    chat = {"messages": [{"role": "user", "content": "stream"}], "max_tokens": 10, "temperature": 0}
    with replicas() as (url, *_):
        whole = answer(url, "/v1/completions", body)["choices"][0]
        events = stream_events(url, "/v1/completions", body)
        chat_whole = answer(url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
        chat_events = stream_events(url, "/v1/chat/completions", chat)
    choices = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert sum((c["logprobs"]["tokens"] for c in choices), []) == whole["logprobs"]["tokens"]
    # a prefix-cache hit on the second (the same prompt) rounds the last float bits differently
    assert same(sum((c["logprobs"]["token_logprobs"] for c in choices), []), whole["logprobs"]["token_logprobs"])
    assert choices[-1]["finish_reason"] == whole["finish_reason"]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chat_events) == chat_whole


def test_a_client_that_leaves_aborts_its_request_on_the_replica():
    body = {"prompt": "a long one", "max_tokens": 80, "temperature": 0, "ignore_eos": True, "stream": True}
    with replicas(step_s=0.02) as (url, front, coordinator, handlers):
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))  # in flight on a replica now
            assert any(h.engine.has_unfinished_requests() for h in handlers)
        wait_until(lambda: not any(h.engine.has_unfinished_requests() for h in handlers), "the abort")
        wait_until(lambda: not coordinator.requests and not front.has_unfinished_requests(), "the front to forget")
        assert all(h.engine.kv.num_free_blocks == ENGINE["num_blocks"] for h in handlers)
        assert all(h.engine.num_steps < 80 for h in handlers)  # cut before its 80 tokens


def test_a_dead_replicas_requests_are_resent_and_health_counts_it_out():
    """The replica holding a stream goes silent after the stream's first tokens: it is dropped after the
    heartbeat timeout, its requests run again on the other, and every client gets the one-engine answer
    (the stream without repeating what it already got). The stream samples without a seed: the front
    seeded it (its first draw of random.Random(0)), so the re-sent one samples the same tokens."""
    greedy = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    sampled = {"max_tokens": 40, "temperature": 1.0, "ignore_eos": True}
    prompts = [f"request {i}" for i in range(4)]
    with live_server(engine(tiny_model(), **ENGINE)) as (url, _, _):
        seed = random.Random(0).getrandbits(63)
        alone = [answer(url, "/v1/completions", {"prompt": prompts[0], **sampled, "seed": seed})["choices"][0]["text"]]
        alone += [answer(url, "/v1/completions", {"prompt": p, **greedy})["choices"][0]["text"] for p in prompts[1:]]
    with replicas(step_s=0.02, heartbeat_timeout_s=2.0) as (url, front, coordinator, handlers):
        assert httpx.get(url + "/health").json()["replicas"] == 2

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                async with c.stream("POST", "/v1/completions", json={"prompt": prompts[0], **sampled,
                                                                     "stream": True}) as s:
                    lines = s.aiter_lines()
                    first = [line async for line in _until_data(lines)]
                    req_id = next(iter(coordinator.requests))
                    victim = coordinator.workers[coordinator.requests[req_id].worker_id].name
                    others = [asyncio.create_task(c.post("/v1/completions", json={"prompt": p, **greedy}))
                              for p in prompts[1:]]
                    await asyncio.sleep(0.3)  # the others are placed, some on the victim
                    handlers[int(victim[1:])].die.set()
                    rest = [line async for line in lines if line.startswith("data:")]
                return first + rest, await asyncio.gather(*others), victim

        streamed, responses, victim = asyncio.run(main())
        wait_until(lambda: httpx.get(url + "/health").json()["replicas"] == 1, "the dead replica to be dropped")
        survivor = next(w for w in coordinator.workers.values())
    assert streamed[-1] == "data: [DONE]"
    text = "".join(json.loads(line[5:])["choices"][0]["text"] for line in streamed[:-1])
    assert [text] + [r.json()["choices"][0]["text"] for r in responses] == alone
    assert survivor.name != victim and survivor.num_served == 4  # everything ended on the survivor


async def _until_data(lines):
    async for line in lines:
        if line.startswith("data:"):
            yield line
            return


def test_engine_flags_round_trip_through_the_serve_parser():
    from meshtron.cli import build_parser
    from meshtron.inference.config import EngineConfig, engine_config_from_args
    from meshtron.inference.dp_serving import engine_flags

    cfg = EngineConfig(num_blocks=64, block_size=8, enable_prefix_caching=False, max_num_seqs=3, seed=11)
    args = build_parser().parse_args(["serve", "--checkpoint", "x", *engine_flags(cfg)])
    assert engine_config_from_args(args) == cfg


# ---- the command ----------------------------------------------------------------------------------------

def replica_pids(front_pid: int) -> dict[str, int]:
    """{replica name: pid} of the front's replica processes (their --replica-name)."""
    children = [int(p) for p in Path(f"/proc/{front_pid}/task/{front_pid}/children").read_text().split()]
    names = {}
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        if "--replica-name" in argv:
            names[argv[argv.index("--replica-name") + 1]] = pid
    return names


MAX_TOKENS = 400  # long enough that a replica still holds several requests when the stats next refresh


@pytest.mark.slow
def test_serve_dp_survives_a_killed_replica(tmp_path):
    """`meshtron serve --dp 2`: SIGKILL one replica process while it holds requests; every client still
    gets the answer of one engine, /health counts 1 replica, the survivor served the re-sent requests,
    and SIGTERM mid-request drains (the request finishes) and stops the survivor (exit 0)."""
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.inference.request import SamplingParams
    from meshtron.testing.multiprocess import free_port
    from tests.inference.helpers import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "tiny", max_len=MAX_TOKENS + 16)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    front = subprocess.Popen([sys.executable, "-m", "meshtron", "serve", "--checkpoint", ckpt, "--port", str(port),
                              "--dp", "2", "--replica-threads", "1", "--heartbeat-timeout", "3", "--num-blocks", "64",
                              "--max-num-seqs", "1", "--log-level", "warning"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    prompts = [f"prompt {i}" for i in range(12)]
    try:
        wait_ready(url, front, timeout_s=300)
        assert httpx.get(url + "/health").json() == {"status": "ok", "replicas": 2}
        pids = replica_pids(front.pid)
        assert sorted(pids) == ["replica-0", "replica-1"]

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=300) as c:
                tasks = [asyncio.create_task(c.post("/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS,
                                                                             "temperature": 0, "ignore_eos": True}))
                         for p in prompts]
                deadline = time.monotonic() + 120
                while True:  # a replica holds several (it runs one at a time): kill it
                    loads = (await c.get("/v1/engine/stats")).json()["replicas"]
                    name = max(loads, key=lambda n: loads[n].get("in_flight", 0), default=None)
                    if name is not None and loads[name].get("in_flight", 0) >= 3:
                        break
                    assert time.monotonic() < deadline, f"no replica held 3 requests at once: {loads}"
                    await asyncio.sleep(0.05)
                os.kill(pids[name], signal.SIGKILL)
                return name, [(await t).json() for t in tasks]

        killed, answers = asyncio.run(main())
        survivor = ({"replica-0", "replica-1"} - {killed}).pop()
        wait_until(lambda: httpx.get(url + "/health").json()["replicas"] == 1, "the killed replica to be dropped")
        served = httpx.get(url + "/v1/engine/stats").json()["replicas"][survivor]["served"]
        local = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_blocks=64)).generate(
            prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        assert [a["choices"][0]["text"] for a in answers] == [o.text for o in local]
        assert served > 6  # its own share and the killed replica's unfinished ones

        async def drained():
            async with httpx.AsyncClient(base_url=url, timeout=300) as c:
                body = {"prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as s:
                    lines = s.aiter_lines()
                    got = [line async for line in _until_data(lines)]
                    front.send_signal(signal.SIGTERM)  # in flight: the drain lets it finish
                    got += [line async for line in lines if line.startswith("data:")]
            return got

        streamed = asyncio.run(drained())
        assert streamed[-1] == "data: [DONE]"
        assert "".join(json.loads(line[5:])["choices"][0]["text"] for line in streamed[:-1]) == local[0].text
        assert front.wait(timeout=120) == 0
        wait_until(lambda: not Path(f"/proc/{pids[survivor]}").exists() or
                   Path(f"/proc/{pids[survivor]}/stat").read_text().split()[2] == "Z", "the survivor to exit", 60)
    finally:
        if front.poll() is None:
            front.kill()
        front.wait()


def test_bad_dp_flags_are_refused_in_one_line():
    from meshtron.cli import build_parser
    from meshtron.config.fields import ConfigError
    from meshtron.inference.dp_serving import check_dp_arguments

    def refused(*flags: str) -> str:
        with pytest.raises(ConfigError) as e:
            check_dp_arguments(build_parser().parse_args(["serve", "--checkpoint", "x", *flags]))
        return str(e.value)

    assert refused("--dp", "-1").startswith("--dp: -1 is not allowed")
    assert refused("--dp", "0").startswith("--dp: 0 starts no replica; give --coordinator-port")
    assert refused("--dp", "2", "--replica-threads", "0").startswith("--replica-threads: 0")
    assert refused("--dp", "2", "--affinity-margin", "-5").startswith("--affinity-margin: -5.0")
    assert refused("--dp", "2", "--heartbeat-timeout", "0").startswith("--heartbeat-timeout: 0.0")
    assert refused("--dp", "2", "--pp", "2").startswith("--pp/--tp: the front of data-parallel replicas runs no model")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_a_parallel_replica_registers_and_answers(tmp_path, layout):
    """`torchrun --nproc-per-node 2 -m meshtron serve --coordinator ADDR [--pp 2]`: the TP group (or the
    2-stage pipeline) registers as one replica (its leader) and answers through the front as the
    single-process engine does."""
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.inference.request import SamplingParams
    from meshtron.testing.multiprocess import free_port
    from tests.inference.helpers import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "tiny")
    coordinator = Coordinator(heartbeat_timeout_s=60).start()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "-m", "meshtron", "serve", "--checkpoint", ckpt, "--coordinator",
                             coordinator.address, "--replica-name", "tp2", "--num-blocks", "64", "--device", "cpu",
                             *layout],
                            cwd=ROOT, env=env)
    prompts = ["tensor", "parallel replica", "x"]
    try:
        front = ReplicaFront(coordinator.address, TOKENIZER)
        front.start_background_loop()
        front.wait_for_replicas(1, 300)
        assert list(front.replicas) == ["tp2"]
        with live_server(front) as (url, _, _):
            texts = [answer(url, "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0})
                     ["choices"][0]["text"] for p in prompts]
        local = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_blocks=64)).generate(
            prompts, SamplingParams(max_tokens=12, temperature=0))
        assert texts == [o.text for o in local]
        stopper = CoordinatorClient(coordinator.address)
        assert stopper.control("STOP")["num_workers"] == 0
        stopper.close()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        coordinator.close()
