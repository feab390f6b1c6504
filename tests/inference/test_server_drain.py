"""The drain on SIGTERM, in-process (uvicorn in a thread, the signal handler called directly): /health
and new requests answer 503 "draining" while requests are in flight; when the drain timeout expires
the requests still running are aborted, their clients get an error naming the drain timeout (an SSE
error event, a 503 body), every KV block is free again and the server stops."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from meshtron.inference.server import build_server
from meshtron.testing.multiprocess import free_port
from tests.inference.helpers import engine, tiny_model, wait_ready

httpx = pytest.importorskip("httpx")
NUM_BLOCKS = 64


def test_drain_answers_503_then_aborts_what_is_left_with_an_error():
    eng = engine(tiny_model(), num_blocks=NUM_BLOCKS, block_size=4)
    # each step takes >= 100 ms, so 80 tokens take >= 8 s: far longer than the 2 s drain timeout (which
    # leaves the checks below time to run while the sockets are still open)
    eng.step_hook = lambda kind, *payload: time.sleep(0.1) if kind == "step" else None
    port = free_port()
    server, state = build_server(lambda: eng, "127.0.0.1", port, drain_timeout_s=2.0, log_level="warning")
    runner = threading.Thread(target=server.run, daemon=True)
    runner.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    body = {"prompt": "drain", "max_tokens": 80, "temperature": 0, "ignore_eos": True}
    streamed, answered = [], []

    def stream():
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            streamed.extend(line for line in r.iter_lines() if line.startswith("data:"))

    def plain():
        answered.append(httpx.post(url + "/v1/completions", json=body, timeout=60))

    clients = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for c in clients:
        c.start()
    for _ in range(1000):
        if len(eng.scheduler.running) == 2:
            break
        time.sleep(0.01)
    assert len(eng.scheduler.running) == 2
    server.handle_exit(signal.SIGTERM, None)
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert httpx.get(url + "/v1/health", timeout=5).status_code == 503
    refused = httpx.post(url + "/v1/completions", json=body, timeout=5)
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    for c in clients:
        c.join(timeout=60)
    runner.join(timeout=60)
    assert not runner.is_alive()

    assert streamed[-1] == "data: [DONE]"
    events = [json.loads(line[5:]) for line in streamed[:-1]]
    assert events[-2]["choices"][0]["finish_reason"] == "abort", streamed[-4:]
    assert "drain timeout (2 s)" in events[-1]["error"]["message"]
    generated = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert 0 < len(generated) < 80  # it ran during the drain, and was cut before it finished
    (response,) = answered
    assert response.status_code == 503 and "drain timeout (2 s)" in response.json()["error"]["message"]
    assert eng.kv.num_free_blocks == NUM_BLOCKS and not eng.has_unfinished_requests()
    assert state.status == "draining"


def test_drain_lets_requests_finish_within_the_timeout():
    """A drain with time to spare aborts nothing: the in-flight request ends with its own finish reason."""
    import asyncio

    from meshtron.inference.request import SamplingParams
    from meshtron.inference.server import ServerState, drain

    eng = engine(tiny_model(), num_blocks=NUM_BLOCKS, block_size=4)
    state = ServerState(status="ready", engine=eng)

    async def main():
        outs = []

        async def consume():
            async for out in eng.stream([1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)):
                outs.append(out)

        task = asyncio.create_task(consume())
        while not outs and not task.done():  # in flight: it has produced its first token
            await asyncio.sleep(0.001)
        aborted = await drain(state, 60.0)
        await task
        return aborted, outs

    try:
        aborted, outs = asyncio.run(main())
    finally:
        eng.shutdown()
    assert aborted == 0 and state.status == "draining"
    assert outs[-1].finish_reason == "length" and outs[-1].error is None and len(outs[-1].token_ids) == 6
