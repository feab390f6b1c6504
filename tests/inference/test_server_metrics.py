"""/metrics in the Prometheus text format, parsed with prometheus_client's own parser and checked
against what the test sent: token counters equal the `usage` fields summed, prefix-cache hits equal
the cached tokens reported, one latency observation per engine request, errors counted by status and
type, and the queue/KV gauges while a stream is in flight and after."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.inference.helpers import engine, tiny_model
from tests.inference.server_helpers import live_server

httpx = pytest.importorskip("httpx")
NUM_BLOCKS = 64


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_metrics_count_what_was_served():
    eng = engine(tiny_model(), num_blocks=NUM_BLOCKS, block_size=4)
    eng.step_hook = lambda kind, *payload: time.sleep(0.01) if kind == "step" else None
    with live_server(eng) as (url, _, _):
        shared = "a prompt long enough to fill several blocks"
        answers = [  # (usage, number of engine requests)
            (post(url, "/v1/completions", {"prompt": ["ab", "cde"], "n": 2, "max_tokens": 3, "temperature": 0.5,
                                           "seed": 1, "ignore_eos": True}).json()["usage"], 4),
            (post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                "temperature": 0}).json()["usage"], 1),
            (post(url, "/v1/completions", {"prompt": shared, "max_tokens": 2, "ignore_eos": True}).json()["usage"], 1),
            (post(url, "/v1/completions", {"prompt": shared, "max_tokens": 2, "ignore_eos": True}).json()["usage"], 1),
        ]
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "xyz", "max_tokens": 40, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            next(lines)
            busy = scrape(url)  # in flight: one running request holding blocks
            last = [line for line in lines if line != "data: [DONE]"][-1]
        answers.append((json.loads(last[5:])["usage"], 1))
        assert post(url, "/v1/completions", {"prompt": "a", "temperature": -1}).status_code == 400
        assert post(url, "/v1/completions", {"prompt": "a", "model": "other"}).status_code == 404
        assert httpx.get(url + "/v1/nothing-here", timeout=30).status_code == 404
        for _ in range(500):  # the engine frees the last blocks just after the answer
            if eng.kv.num_free_blocks == NUM_BLOCKS:
                break
            time.sleep(0.01)
        m = scrape(url)

    assert busy[("meshtron_requests_running", ())] == 1 and busy[("meshtron_requests_waiting", ())] == 0
    assert busy[("meshtron_kv_blocks_used", ())] >= 1
    assert m[("meshtron_requests_running", ())] == 0 and m[("meshtron_kv_blocks_used", ())] == 0
    assert m[("meshtron_kv_blocks_total", ())] == NUM_BLOCKS
    usages = [u for u, _ in answers]
    assert m[("meshtron_prompt_tokens_total", ())] == sum(u["prompt_tokens"] for u in usages)
    assert m[("meshtron_generation_tokens_total", ())] == sum(u["completion_tokens"] for u in usages)
    hits = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert hits > 0 and m[("meshtron_prefix_cache_hits_total", ())] == hits
    # queried per engine request: a prompt with n = 2 is looked up twice
    assert m[("meshtron_prefix_cache_queries_total", ())] == 2 * usages[0]["prompt_tokens"] + sum(
        u["prompt_tokens"] for u in usages[1:])
    num_requests = sum(k for _, k in answers)
    assert sum(v for (name, _), v in m.items() if name == "meshtron_requests_finished_total") == num_requests
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert m[(f"meshtron_{name}_seconds_count", ())] == num_requests, name
        assert m[(f"meshtron_{name}_seconds_sum", ())] > 0, name
    errors = {labels: v for (name, labels), v in m.items() if name == "meshtron_errors_total"}
    assert errors == {(("status", "400"), ("type", "invalid_request_error")): 1,
                      (("status", "404"), ("type", "invalid_request_error")): 2}
