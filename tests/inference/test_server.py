"""`meshtron serve` on 127.0.0.1 driven by the official `openai` client: completions, chat, streaming,
usage and ids; 400s with messages for bad parameters; the API key from MESHTRON_API_KEY and a limit
flag reach the server; a disconnected stream frees its blocks; 200 concurrent requests all complete;
SIGTERM drains an in-flight stream and exits. Health states (loading / ready / failed) are checked
in-process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from meshtron.testing.multiprocess import free_port
from tests.inference.helpers import save_tiny_checkpoint, wait_ready

openai = pytest.importorskip("openai")
NUM_BLOCKS = 256
KEY = "sk-serve-test"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-run")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MESHTRON_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", "serve", "--checkpoint", ckpt, "--host", "127.0.0.1",
                             "--port", str(port), "--num-blocks", str(NUM_BLOCKS), "--block-size", "4",
                             "--drain-timeout", "60", "--log-level", "warning", "--max-stop", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def test_models_and_completions(server):
    url, _ = server
    c = client(url)
    model = c.models.list().data[0].id
    assert model == "tiny-run"
    r = c.completions.create(model=model, prompt="def f(", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 5 and r.usage.total_tokens == 11
    again = c.completions.create(model=model, prompt="def f(", max_tokens=5, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text
    two = c.completions.create(model=model, prompt=["a", "bc"], n=2, max_tokens=3, temperature=0.7, seed=1, logprobs=2)
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3] and two.usage.prompt_tokens == 3
    assert len(two.choices[0].logprobs.token_logprobs) == len(two.choices[0].logprobs.tokens)


def test_chat_and_streaming(server):
    url, _ = server
    c = client(url)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="tiny-run", messages=messages, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens >= 1
    chunks = list(c.chat.completions.create(model="tiny-run", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    stream = c.completions.create(model="tiny-run", prompt="xy", max_tokens=7, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    pieces = list(stream)
    assert pieces[-1].choices[0].finish_reason == "length"
    full = c.completions.create(model="tiny-run", prompt="xy", max_tokens=7, temperature=0,
                                extra_body={"ignore_eos": True})
    assert "".join(p.choices[0].text for p in pieces) == full.choices[0].text


def test_request_id_header_and_bad_request(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2},
                   headers={"x-request-id": "abc", **AUTH})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc"
    assert r.json()["id"].startswith("cmpl-")  # the server's own id; the client's is only echoed
    with pytest.raises(openai.BadRequestError) as err:
        client(url).completions.create(model="tiny-run", prompt="a", max_tokens=0)
    assert "max_tokens" in str(err.value)


def test_the_api_key_and_the_limit_flags_reach_the_server(server):
    url, _ = server
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/docs"):
        refused = httpx.get(url + path)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + path, headers=AUTH).status_code == 200
    with pytest.raises(openai.BadRequestError) as err:
        client(url).completions.create(model="tiny-run", prompt="a", max_tokens=2, stop=["x", "y", "z"])
    assert "--max-stop" in str(err.value)


def stats(url):
    return httpx.get(url + "/v1/engine/stats", headers=AUTH, timeout=10).json()


def test_disconnected_stream_frees_its_blocks(server):
    url, _ = server
    body = {"prompt": "hello there", "max_tokens": 80, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
        busy = stats(url)
        assert busy["num_running"] + busy["num_waiting"] == 1 and busy["num_free_blocks"] < NUM_BLOCKS
    for _ in range(300):  # the server notices the closed socket and aborts
        s = stats(url)  # read without the engine's lock: wait for the whole abort, blocks freed included
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == NUM_BLOCKS:
            break
        time.sleep(0.05)
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["num_free_blocks"] == NUM_BLOCKS


def test_200_concurrent_requests_complete(server):
    url, _ = server

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        async def one(i):
            if i % 2:
                return await c.completions.create(model="tiny-run", prompt=f"request {i}", max_tokens=4 + i % 5,
                                                  temperature=0.8, seed=i)
            return await c.chat.completions.create(model="tiny-run", max_tokens=3 + i % 4, temperature=0,
                                                   messages=[{"role": "user", "content": f"number {i}"}])
        try:
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await c.close()

    results = asyncio.run(main())
    assert len(results) == 200
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    assert stats(url)["num_free_blocks"] == NUM_BLOCKS


def test_sigterm_drains_in_flight_requests(server):
    """Runs last: it stops the module's server."""
    url, proc = server
    body = {"prompt": "drain", "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
    received = []

    def consume():
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            received.extend(line for line in r.iter_lines() if line.startswith("data:"))

    reader = threading.Thread(target=consume)
    reader.start()
    for _ in range(400):
        if stats(url)["num_running"]:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    reader.join(timeout=120)
    assert received[-1] == "data: [DONE]"
    finals = [json.loads(x[5:]) for x in received[:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=60) == 0
