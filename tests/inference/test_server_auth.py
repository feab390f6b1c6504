"""With an API key, every route but /health and /v1/health needs `Authorization: Bearer <key>`: a
missing, wrong or non-Bearer credential is a 401 in OpenAI's error shape; the key comes from the
flag, else MESHTRON_API_KEY; keys are compared in constant time."""

from __future__ import annotations

import time

import pytest

from meshtron.inference import server_auth
from meshtron.inference.server import build_app
from meshtron.inference.server_auth import API_KEY_ENV, resolve_api_key
from tests.inference.helpers import engine, tiny_model

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

KEY = "sk-test-0123456789"
ROUTES = [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("GET", "/v1/models"),
          ("GET", "/v1/engine/stats"), ("GET", "/metrics"),
          ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2}),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}),
          ("GET", "/v1/no-such-route")]


@pytest.fixture(scope="module")
def client():
    eng = engine(tiny_model(), num_blocks=32, block_size=4)
    with TestClient(build_app(lambda: eng, api_key=KEY)) as c:
        for _ in range(500):
            if c.get("/health").status_code == 200:
                break
            time.sleep(0.01)
        yield c


def call(client, route, headers):
    method, path, *body = route
    return client.request(method, path, json=body[0] if body else None, headers=headers)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]} {r[1]}")
@pytest.mark.parametrize("credential", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", KEY, "Bearer "])
def test_every_route_but_health_needs_the_key(client, route, credential):
    r = call(client, route, {"authorization": credential} if credential else {})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]} {r[1]}")
def test_the_right_key_opens_every_route(client, route):
    r = call(client, route, {"authorization": f"Bearer {KEY}"})
    assert r.status_code == (404 if route[1] == "/v1/no-such-route" else 200), r.text


def test_health_needs_no_key(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/health").status_code == 200


def test_keys_are_compared_in_constant_time(client, monkeypatch):
    seen = []
    monkeypatch.setattr(server_auth.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or a == b)
    assert client.get("/v1/models", headers={"authorization": "Bearer guess"}).status_code == 401
    assert seen == [(b"guess", KEY.encode())]


def test_the_key_comes_from_the_flag_else_the_environment():
    assert resolve_api_key("flag", {API_KEY_ENV: "env"}) == "flag"
    assert resolve_api_key(None, {API_KEY_ENV: "env"}) == "env"
    assert resolve_api_key(None, {}) is None and resolve_api_key("", {API_KEY_ENV: ""}) is None


def test_without_a_key_nothing_is_asked():
    eng = engine(tiny_model(), num_blocks=32, block_size=4)
    with TestClient(build_app(lambda: eng)) as c:
        for _ in range(500):
            if c.get("/health").status_code == 200:
                break
            time.sleep(0.01)
        assert c.get("/v1/models").status_code == 200
