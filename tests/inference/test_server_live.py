"""A live server on 127.0.0.1 (uvicorn in a thread): two clients sending the same X-Request-Id each get
their own text, the id echoed back; a client that times out or cuts its stream leaves one log line,
no traceback; an engine that stops for good makes `serve` return 1."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest

from meshtron.inference.server import serve
from meshtron.testing.multiprocess import free_port
from tests.inference.helpers import engine, tiny_model, wait_ready
from tests.inference.server_helpers import Records, live_server

httpx = pytest.importorskip("httpx")


def slow_engine(step_s: float):
    eng = engine(tiny_model(), num_blocks=64, block_size=4)
    eng.step_hook = lambda kind, *payload: time.sleep(step_s) if kind == "step" else None
    return eng


def greedy(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}


async def data_line(lines) -> str:
    async for line in lines:
        if line.startswith("data:"):
            return line
    raise AssertionError("the stream ended early")


def test_the_same_client_request_id_twice_gives_each_client_its_own_text():
    eng = slow_engine(0.01)
    with live_server(eng) as (url, _, _):
        alone = [httpx.post(url + "/v1/completions", json=greedy(p), timeout=60).json()["choices"][0]["text"]
                 for p in ("first prompt", "other words")]

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60, headers={"x-request-id": "same"}) as c:
                async with c.stream("POST", "/v1/completions", json={**greedy("first prompt"), "stream": True}) as a:
                    lines = a.aiter_lines()
                    first = [await data_line(lines)]  # the first request is in flight now
                    b = await c.post("/v1/completions", json=greedy("other words"))
                    rest = [line async for line in lines if line.startswith("data:")]
                return a.headers, first + rest, b

        a_headers, a_lines, b = asyncio.run(main())
    a_events = [json.loads(line[5:]) for line in a_lines if line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in a_events) == alone[0]
    assert b.status_code == 200 and b.json()["choices"][0]["text"] == alone[1]
    assert a_headers["x-request-id"] == b.headers["x-request-id"] == "same"  # echoed, never a key
    assert a_events[0]["id"].startswith("cmpl-") and b.json()["id"].startswith("cmpl-")
    assert a_events[0]["id"] != b.json()["id"]


def test_a_client_that_times_out_or_cuts_its_stream_leaves_no_traceback():
    eng = slow_engine(0.05)
    with live_server(eng, log_level="info") as (url, _, _), Records() as log:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={**greedy("a"), "max_tokens": 60}, timeout=0.5,
                       headers={"x-request-id": "impatient"})
        with httpx.stream("POST", url + "/v1/completions", json={**greedy("b"), "max_tokens": 60, "stream": True,
                                                                  "stream_options": {"include_usage": True}},
                          timeout=30) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))
        for _ in range(600):  # until the server has noticed both and aborted their requests
            if not eng.has_unfinished_requests() and sum("went away" in r.getMessage() for r in log.records) >= 1:
                break
            time.sleep(0.01)
        time.sleep(0.3)  # anything the cancelled tasks would log comes now
    assert not eng.has_unfinished_requests()
    assert [r for r in log.records if r.exc_info or r.levelno >= logging.ERROR] == []
    messages = [r.getMessage() for r in log.records]
    assert any("client request id 'impatient'" in m for m in messages)
    assert any("the client went away" in m for m in messages)


def test_an_engine_that_stops_for_good_makes_serve_return_1():
    eng = engine(tiny_model(), num_blocks=32, block_size=4)
    port, result = free_port(), []
    runner = threading.Thread(target=lambda: result.append(serve(lambda: eng, "127.0.0.1", port,
                                                                 log_level="critical")), daemon=True)
    runner.start()
    wait_ready(f"http://127.0.0.1:{port}")
    eng.fatal_error = "RuntimeError: the step failed"
    runner.join(timeout=60)
    assert result == [1]
