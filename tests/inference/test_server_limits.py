"""Request limits: each bound is a 400 naming the parameter and the flag (a body over the byte limit a
413, before it is parsed, whether its size is declared or chunked); a text prompt too long for the
context is refused without being tokenized; tokenizing runs off the event loop, so a small request is
answered while a large one is still being tokenized."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from meshtron.inference.server import build_app
from meshtron.inference.server_config import ServerConfig
from tests.inference.helpers import TOKENIZER, engine, tiny_model
from tests.inference.server_helpers import GatedTokenizer, live_server

httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

LIMITS = ServerConfig(max_body_bytes=4096, max_prompts=3, max_n=4, max_choices=6, max_stop=2, max_stop_chars=5,
                      max_stop_token_ids=3, max_chars_per_token=2)
MAX_LEN = 96


@pytest.fixture(scope="module")
def client():
    eng = engine(tiny_model(max_len=MAX_LEN), num_blocks=64, block_size=4)
    with TestClient(build_app(lambda: eng, LIMITS)) as c:
        for _ in range(500):
            if c.get("/health").status_code == 200:
                break
            time.sleep(0.01)
        yield c


OVER = [  # (body, param, flag): one past each limit
    ({"prompt": ["a", "b", "c", "d"]}, "prompt", "--max-prompts"),
    ({"prompt": "a", "n": 5}, "n", "--max-n"),
    ({"prompt": ["a", "b"], "n": 4}, "n", "--max-choices"),
    ({"prompt": "a", "stop": ["x", "y", "z"]}, "stop", "--max-stop"),
    ({"prompt": "a", "stop": ["x", "abcdef"]}, "stop[1]", "--max-stop-chars"),
    ({"prompt": "a", "stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids", "--max-stop-token-ids"),
    ({"prompt": "x" * (2 * MAX_LEN + 1)}, "prompt", "--max-chars-per-token"),
    ({"prompt": ["a", "x" * (2 * MAX_LEN + 1)]}, "prompt[1]", "--max-chars-per-token"),
]
AT = [  # each limit exactly: accepted
    {"prompt": ["a", "b", "c"], "n": 2}, {"prompt": "a", "n": 4}, {"prompt": "a", "stop": ["x", "abcde"]},
    {"prompt": "a", "stop_token_ids": [1, 2, 3]},
]


@pytest.mark.parametrize("body, param, flag", OVER)
def test_each_limit_is_a_400_naming_its_flag(client, body, param, flag):
    r = client.post("/v1/completions", json={"max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and flag in error["message"], error


@pytest.mark.parametrize("body", AT)
def test_requests_at_the_limits_are_served(client, body):
    r = client.post("/v1/completions", json={"max_tokens": 1, **body})
    assert r.status_code == 200, r.text


def test_chat_text_longer_than_the_context_can_hold_is_refused(client):
    messages = [{"role": "user", "content": "x" * MAX_LEN}, {"role": "user", "content": "y" * (MAX_LEN + 1)}]
    r = client.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400 and "--max-chars-per-token" in r.json()["error"]["message"]


def test_token_id_prompt_longer_than_the_context_is_refused(client):
    r = client.post("/v1/completions", json={"prompt": [1] * (MAX_LEN + 1)})
    assert r.status_code == 400 and "exceed the context length" in r.json()["error"]["message"]


def test_a_body_over_the_byte_limit_is_413_declared_or_chunked(client):
    big = b'{"prompt": "' + b"x" * 5000 + b'"}'
    declared = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"
    assert "--max-body-bytes" in declared.json()["error"]["message"]
    chunked = client.post("/v1/completions", content=iter([big[:3000], big[3000:]]))
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


def test_a_declared_size_over_the_limit_is_refused_before_the_body_is_sent():
    """Only the headers go out: the answer comes without the server waiting for 10^9 bytes."""
    eng = engine(tiny_model(max_len=MAX_LEN), num_blocks=32, block_size=4)
    with live_server(eng, config=LIMITS) as (url, _, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000000000\r\n\r\n")
            reply = b""
            while b"request_too_large" not in reply and (chunk := s.recv(4096)):
                reply += chunk
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and '"code":"request_too_large"' in reply


def test_tokenizing_is_off_the_event_loop_and_a_huge_prompt_is_never_tokenized():
    eng = engine(tiny_model(max_len=MAX_LEN), num_blocks=64, block_size=4)
    eng.tokenizer = gated = GatedTokenizer(TOKENIZER)
    small = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with live_server(eng, config=ServerConfig(max_body_bytes=16 * 2**20)) as (url, _, _):
        alone = httpx.post(url + "/v1/completions", json=small, timeout=60).json()["choices"][0]["text"]

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                huge = await c.post("/v1/completions", json={"prompt": "x" * 4 * 2**20})
                # within the character bound, so it is tokenized (slowly), then refused by the engine
                big = asyncio.create_task(c.post("/v1/completions", json={"prompt": "BIG" + "x" * 2000}))
                assert await asyncio.to_thread(gated.entered.wait, 30)
                try:  # the big request is held inside encode; the small one must still be answered
                    answered = await c.post("/v1/completions", json=small, timeout=20)
                    still_tokenizing = not big.done()
                finally:
                    gated.release.set()
                return huge, answered, still_tokenizing, await big

        huge, answered, still_tokenizing, big = asyncio.run(main())
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt"
    assert max(gated.lengths) < 4 * 2**20  # refused by its length alone, never tokenized
    assert answered.status_code == 200 and answered.json()["choices"][0]["text"] == alone
    assert still_tokenizing
    assert big.status_code == 400 and "context length" in big.json()["error"]["message"]


def test_every_limit_is_documented_with_its_flag_and_default():
    import dataclasses
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    for f in dataclasses.fields(ServerConfig):
        row = next((line for line in doc.splitlines() if line.startswith(f"| `--{f.name.replace('_', '-')}` |")), "")
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 3, f"docs/serving.md has no row for --{f.name}"
        assert int(cells[1].split()[0].replace(",", "")) == f.default and cells[2] == f.metadata["help"], row


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "stop": ["x"] * 3}, "stop"),
    ({"prompt": "a", "stop_token_ids": [1] * 4}, "stop_token_ids"),
    ({"prompt": ["a"] * 4}, "prompt"),
    ({"prompt": [1] * (MAX_LEN + 1)}, "prompt"),
])
def test_long_lists_are_refused_before_validation(client, body, param, monkeypatch):
    """The hostile-load benchmark's slowest cases (100k stop strings, 1,000 prompts) cost a field-by-field
    validation of the whole list before the limit refused them; now their length alone refuses them."""
    from meshtron.inference import protocol

    def never(*args, **kwargs):
        raise AssertionError("validated a body whose list was over its limit")

    monkeypatch.setattr(protocol.CompletionRequest, "model_validate", never)
    r = client.post("/v1/completions", json={"max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
