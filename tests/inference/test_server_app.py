"""The FastAPI app in-process: /health through loading, ready, failed and an engine that stopped for
good; every invalid parameter answered 400 with a message naming it; every other client error (bad
JSON, wrong types, non-finite numbers, lone surrogates, unknown models and URLs, non-text chat parts)
in OpenAI's error shape, never a 500."""

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
    ({"prompt": "a", "logprobs": 50}, "logprobs"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "repetition_penalty": 1e-300}, "repetition_penalty"),  # overflowed the logits: was a 500
    ({"prompt": "a", "repetition_penalty": 1e30}, "repetition_penalty"),
    ({"prompt": "a", "min_tokens": 17}, "min_tokens"),
    ({"prompt": "a", "logit_bias": {"7": 101}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"100000": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"7": "1"}}, "logit_bias.7"),
    ({"prompt": "a", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "a", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
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
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x1": 2}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -2}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 40}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
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


def test_engine_that_stops_for_good_turns_health_503_with_the_reason(model):
    eng = engine(model, num_blocks=32, block_size=4)
    with TestClient(build_app(lambda: eng)) as client:
        wait_for(client, 200)
        eng.fatal_error = "RuntimeError: the step failed"  # what the engine's loop sets when it cannot go on
        r = wait_for(client, 503)
        assert r.json() == {"status": "failed", "error": "the engine stopped: RuntimeError: the step failed"}
        refused = client.post("/v1/completions", json={"prompt": "a"})
        assert refused.status_code == 503 and "RuntimeError: the step failed" in refused.json()["error"]["message"]


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


RAW = [  # (body bytes, what the message says)
    (b'{"prompt": "a",, }', "not valid JSON: Expecting property name enclosed in double quotes at line 1 column 16"),
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8 (byte 12)"),
    (b'[{"prompt": "a"}]', "must be a JSON object, not list"),
    (b'"a"', "must be a JSON object, not str"),
    (b'{"prompt": "a", "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"prompt": "a", "temperature": Infinity}', "Infinity is not a JSON number"),
    (b'{"prompt": "a", "top_p": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"prompt": "a", "temperature": 1e999}', "1e999 overflows a double"),
    (b'{"prompt": "a", "seed": 1' + b"0" * 5000 + b"}", "digits"),
    (b"[" * 100_000, "nested too deeply"),
    (b"", "Expecting value at line 1 column 1"),
]


@pytest.mark.parametrize("raw, message", RAW)
def test_bodies_that_are_not_a_json_object_are_400_in_openai_shape(ready_client, raw, message):
    error = error_of(ready_client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
                     400)
    assert message in error["message"] and error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


TYPES = [  # (body, param): the value has the wrong type, or is not finite
    ({"prompt": [1.0, 2]}, "prompt[0]"),
    ({"prompt": [1, 2.5]}, "prompt[1]"),
    ({"prompt": [True]}, "prompt[0]"),
    ({"prompt": [[1, 2], [3, False]]}, "prompt[1][1]"),
    ({"prompt": ["a", [1]]}, "prompt"),
    ({"prompt": {"text": "a"}}, "prompt"),
    ({"prompt": "a", "stop_token_ids": [1.0]}, "stop_token_ids[0]"),
    ({"prompt": "a", "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ({"prompt": "a", "n": True}, "n"),
    ({"prompt": "a", "n": 2.0}, "n"),
    ({"prompt": "a", "max_tokens": False}, "max_tokens"),
    ({"prompt": "a", "temperature": True}, "temperature"),
    ({"prompt": "a", "temperature": "0.5"}, "temperature"),
    ({"prompt": "a", "stream": 1}, "stream"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "stop": ["x", 3]}, "stop[1]"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": "a", "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ({"prompt": "a", "model": 3}, "model"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": ["ok", "a\udfffb"]}, "prompt[1]"),
    ({"prompt": "a", "stop": ["\udc00"]}, "stop[0]"),
]


@pytest.mark.parametrize("body, param", TYPES)
def test_wrong_types_and_lone_surrogates_are_400_naming_the_parameter(ready_client, body, param):
    import json

    raw = json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as the escape \ud800
    error = error_of(ready_client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
                     400)
    assert error["param"] == param and error["message"].startswith(param), error


def test_unknown_model_is_404_as_openai_answers_it(ready_client):
    error = error_of(ready_client.post("/v1/completions", json={"model": "gpt-9", "prompt": "a"}), 404)
    assert error == {"message": "The model `gpt-9` does not exist; this server serves `meshtron`", "param": "model",
                     "type": "invalid_request_error", "code": "model_not_found"}
    chat = ready_client.post("/v1/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "a"}]})
    assert error_of(chat, 404)["code"] == "model_not_found"
    for model in ("", None, "meshtron"):  # empty or absent: the served model
        r = ready_client.post("/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_unknown_url_and_method_are_openai_shaped(ready_client):
    assert error_of(ready_client.get("/v1/nope"), 404)["message"] == "Invalid URL (GET /v1/nope)"
    assert "GET is not allowed" in error_of(ready_client.get("/v1/completions"), 405)["message"]


def chat(client, content, **extra):
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                     "max_tokens": 6, "temperature": 0, **extra})


def test_chat_text_parts_are_joined_and_other_parts_refused(ready_client):
    whole = chat(ready_client, "hello there")
    parts = chat(ready_client, [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}])
    assert whole.status_code == parts.status_code == 200
    assert parts.json()["choices"][0]["message"] == whole.json()["choices"][0]["message"]
    for part in ({"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                 {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}):
        error = error_of(chat(ready_client, [{"type": "text", "text": "a"}, part]), 400)
        assert error["param"] == "messages[0].content[1].type" and repr(part["type"]) in error["message"]
    assert error_of(chat(ready_client, [{"type": "text", "text": 3}]), 400)["param"] == "messages[0].content[0].text"
    assert error_of(chat(ready_client, {"text": "a"}), 400)["param"] == "messages[0].content"


def test_top_logprobs_needs_logprobs(ready_client):
    error = error_of(chat(ready_client, "a", top_logprobs=2), 400)
    assert error["param"] == "top_logprobs" and "logprobs must be true" in error["message"]
    assert chat(ready_client, "a", top_logprobs=2, logprobs=True).status_code == 200


def test_log_probs_of_minus_infinity_are_reported_as_a_number(ready_client):
    """With processed log probs and top_k=1 every alternative has log prob -inf, which JSON cannot
    carry (it was a 500): it is reported as -9999.0, as OpenAI does."""
    r = ready_client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "temperature": 0.7, "top_k": 1,
                                                   "logprobs": 3, "logprobs_mode": "processed", "seed": 0})
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert all(v in (0.0, -9999.0) for top in tops for v in top.values()) and any(-9999.0 in t.values() for t in tops)


def test_the_api_page_shows_the_request_bodies(ready_client):
    spec = ready_client.get("/openapi.json").json()
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "max_tokens", "stop_token_ids"} <= set(body["properties"]) and "$ref" not in str(body)


def test_a_fault_inside_a_route_is_a_json_500_and_a_tokenizer_refusal_a_400(ready_client, monkeypatch):
    eng = ready_client.app.state.server.engine

    def broken() -> dict:
        raise RuntimeError("stats broke")

    monkeypatch.setattr(eng, "stats", broken)
    r = TestClient(ready_client.app, raise_server_exceptions=False).get("/v1/engine/stats")
    assert error_of(r, 500) == {"message": "internal server error: RuntimeError: stats broke", "type": "server_error",
                                "param": None, "code": None}

    def strict_encode(text: str) -> list[int]:
        raise ValueError("special token '<|endoftext|>' is not allowed in text")

    monkeypatch.setattr(eng.tokenizer, "encode", strict_encode)
    error = error_of(ready_client.post("/v1/completions", json={"prompt": ["a", "<|endoftext|>"]}), 400)
    assert error["param"] == "prompt[0]" and "special token" in error["message"]
