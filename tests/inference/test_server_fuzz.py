"""Fuzzing the HTTP API with hypothesis against a live server on 127.0.0.1: generated bodies (valid and
invalid shapes, extreme numbers, odd Unicode with lone surrogates, wrong types, lists up to the
limits, bytes that are not JSON) never get a 5xx or a `server_error` event, each is answered within
the client's timeout, and afterwards a greedy request still returns the text it returned before.
The default run is derandomized (the same examples every time); the slow one draws new ones."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtron.inference.server_config import ServerConfig
from tests.inference.helpers import engine, tiny_model
from tests.inference.server_helpers import live_server

httpx = pytest.importorskip("httpx")
MAX_LEN, NUM_BLOCKS = 64, 128
LIMITS = ServerConfig(max_prompts=4, max_n=4, max_choices=8, max_stop=4, max_stop_chars=16, max_stop_token_ids=8)
TIMEOUT_S = 60.0  # per request: a bound on hangs, not a latency threshold
GREEDY = {"prompt": "def fuzz(", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
texts = st.one_of(st.text(max_size=24), surrogates, st.builds(lambda a, b: a + b, st.text(max_size=8), surrogates),
                  st.sampled_from(["", "<|im_end|>", "\x00", "\u202e", "🙂" * 5, "a" * 300]))
numbers = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 1e-300, 5e-324, -0.0, 1e308, 0.5, 2.0]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(texts, inner, max_size=3)), max_leaves=8)
token_ids = st.lists(st.one_of(st.integers(-3, 300), st.sampled_from([True, 1.0, 2**64, 10**30])), max_size=8)
parts = st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                           st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "text", 3])}),
                           anything), max_size=3)
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), texts)},
                                          optional={"content": st.one_of(texts, parts, anything), "name": texts}),
                    max_size=4)
plain = st.text(st.characters(codec="utf-8"), max_size=24)  # valid Unicode: these reach the engine
ids = st.lists(st.integers(0, 255), min_size=1, max_size=8)
PLAUSIBLE = {  # values of the right type, most in range, some at or past an edge
    "model": st.sampled_from(["", "meshtron"]), "temperature": st.one_of(st.floats(0, 2), st.sampled_from(
        [0, 1e-300, 5e-324, 1e-7, 2**-126])), "top_p": st.floats(0, 1), "n": st.integers(1, 4),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=4)),
    "seed": st.one_of(st.integers(-(2**64), 2**64 + 5), st.sampled_from([2**63 - 1, 2**64 - 1, 2**64 - 2, -1])),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=4), "logprobs_mode": st.sampled_from(["raw", "processed"]),
    "max_tokens": st.integers(0, 24), "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.one_of(st.floats(0, 3), st.sampled_from([1e-300, 5e-324, 1e-30, 1e30, 1e300])),
    "min_tokens": st.integers(-1, 30), "prompt_logprobs": st.integers(-1, 22),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-2, 300).map(str), texts),
                                  st.one_of(st.floats(-150, 150), numbers), max_size=4),
}
COMPLETION = {**PLAUSIBLE, "logprobs": st.integers(0, 5), "echo": st.booleans(),
              "return_tokens_as_token_ids": st.booleans()}
CHAT = {**PLAUSIBLE, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
        "max_completion_tokens": st.integers(1, 24)}
prompts = st.one_of(plain, st.lists(plain, min_size=1, max_size=4), ids, st.lists(ids, min_size=1, max_size=4))
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain}), min_size=1, max_size=3)
chats = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                        "content": st.one_of(plain, text_parts)}), min_size=1, max_size=3)
WILD_KEYS = [*COMPLETION, *CHAT, "prompt", "messages", "best_of", "suffix", "tools", ""]


@st.composite
def bodies(draw, path: str) -> dict:
    """A plausible body; half the time one field (or a new one) is set to anything at all, or a
    required field is dropped."""
    fields = COMPLETION if path == "/v1/completions" else CHAT
    required = {"prompt": prompts} if path == "/v1/completions" else {"messages": chats}
    body = draw(st.fixed_dictionaries(required, optional=fields))
    mutation = draw(st.sampled_from(["none", "none", "value", "drop", "odd-part"]))
    if mutation == "value":
        body[draw(st.one_of(st.sampled_from(WILD_KEYS), texts))] = draw(anything)
    elif mutation == "drop":
        body.pop(next(iter(required)))
    elif mutation == "odd-part" and path != "/v1/completions":
        body["messages"][0]["content"] = draw(st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["image_url", "input_audio", "text", 3])}), min_size=1, max_size=2))
    elif mutation == "odd-part":
        body["prompt"] = draw(st.one_of(texts, st.lists(texts, max_size=5), token_ids, st.lists(token_ids, max_size=4)))
    return body


@st.composite
def requests(draw):
    """(path, body bytes): JSON with NaN/Infinity as Python writes them, surrogates as \\u escapes;
    sometimes cut short, not an object, or not JSON at all."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    raw = json.dumps(draw(bodies(path))).encode()
    kind = draw(st.sampled_from(["json"] * 7 + ["cut", "top-level", "bytes"]))
    if kind == "cut":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif kind == "top-level":
        raw = json.dumps(draw(anything)).encode()
    elif kind == "bytes":
        raw = draw(st.binary(max_size=64))
    return path, raw


@pytest.fixture(scope="module")
def server():
    eng = engine(tiny_model(max_len=MAX_LEN), num_blocks=NUM_BLOCKS, block_size=4)
    with live_server(eng, config=LIMITS) as (url, _, _):
        with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
            expected = client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
            yield client, eng, expected


def check(client: httpx.Client, path: str, raw: bytes) -> None:
    with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        text = r.read().decode("utf-8", "replace")
    assert r.status_code < 500, (r.status_code, text[:500], raw[:300])
    if r.status_code >= 400:
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    assert '"type": "server_error"' not in text and '"type":"server_error"' not in text, (text[:500], raw[:300])


def still_serves(client: httpx.Client, eng, expected: str) -> None:
    assert client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == expected
    for _ in range(500):
        if not eng.has_unfinished_requests() and eng.kv.num_free_blocks == NUM_BLOCKS:
            break
        time.sleep(0.01)
    assert not eng.has_unfinished_requests() and eng.kv.num_free_blocks == NUM_BLOCKS


FAST = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


def test_fuzzed_requests_get_no_5xx_and_the_server_still_serves(server):
    client, eng, expected = server

    @FAST
    @given(requests())
    def one(request):
        check(client, *request)

    one()
    still_serves(client, eng, expected)


@pytest.mark.slow
def test_fuzzed_requests_longer_run(server):
    client, eng, expected = server

    @settings(FAST, max_examples=600, derandomize=False)
    @given(requests())
    def one(request):
        check(client, *request)

    one()
    still_serves(client, eng, expected)
