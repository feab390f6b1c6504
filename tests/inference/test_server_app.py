"""The FastAPI app in-process: /health through loading, ready and failed; every invalid parameter
answered 400 with a message naming it."""

from __future__ import annotations

import threading

import pytest

from meshtron.inference.engine import LLMEngine
from meshtron.inference.server import build_app
from tests.inference.helpers import TOKENIZER, engine, tiny_model

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_model("gqa-rope")


def wait_for(client, status_code, tries=500):
    for _ in range(tries):
        r = client.get("/health")
        if r.status_code == status_code:
            return r
        threading.Event().wait(0.01)
    raise AssertionError(f"/health never answered {status_code}")


def test_health_loading_then_ready(model):
    gate = threading.Event()

    def factory() -> LLMEngine:
        gate.wait(30)
        return engine(model, num_blocks=32, block_size=4)

    with TestClient(build_app(factory)) as client:
        r = client.get("/v1/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 503
        gate.set()
        assert wait_for(client, 200).json() == {"status": "ok"}


def test_health_failed():
    def factory() -> LLMEngine:
        raise FileNotFoundError("no such checkpoint")

    with TestClient(build_app(factory)) as client:
        r = wait_for(client, 503)
        for _ in range(500):
            if r.json()["status"] == "failed":
                break
            r = client.get("/health")
        assert r.json()["status"] == "failed" and "no such checkpoint" in r.json()["error"]


BAD = [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "min_p": 3}, "min_p"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "logprobs": 50}, "top_log_probs"),
    ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "a", "stop_token_ids": [10_000_000]}, "stop_token_ids"),
]


@pytest.fixture(scope="module")
def ready_client(model):
    with TestClient(build_app(lambda: engine(model, num_blocks=64, block_size=4))) as client:
        wait_for(client, 200)
        yield client


@pytest.mark.parametrize("body, param", BAD)
def test_bad_completion_parameters(ready_client, body, param):
    r = ready_client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"messages": [], "max_tokens": 2}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -2}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 40}, "top_log_probs"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
])
def test_bad_chat_parameters(ready_client, body, param):
    r = ready_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_fallback_chat_template_stops_at_end_marker(ready_client):
    r = ready_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and "<|im_end|>" not in r.json()["choices"][0]["message"]["content"]
    assert TOKENIZER.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") != []


def test_tokenizer_chat_template_is_rendered():
    from meshtron.inference.chat_template import render_chat

    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    text, stops = render_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], template, TOKENIZER)
    assert text == "[user]hi[assistant]" and stops == ()
