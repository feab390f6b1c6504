"""benchmarks/hostile_load.py on a tiny run: every JSON field is there and consistent (each good request
sent is counted once, completed requests equal requests sent, ratios are B/A, C/A and B/C of the
phases' own numbers, hostile outcomes add up to the requests the hostile client made, the control
client's requests all succeed), the reference texts equal an independent greedy decode of the served
model, and a server that answers 500 to everything is reported as failing every case."""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest

from meshtron.bench.hostile import main, parse_args
from meshtron.bench.hostile_cases import CaseRecord, HostileContext, build_cases, hostile_loop, status_outcome
from tests.inference.helpers import TOKENIZER, engine, reference_greedy, tiny_model
from tests.inference.server_helpers import live_server

httpx = pytest.importorskip("httpx")

TINY = ["--clients", "2", "--requests", "3", "--max-tokens", "4", "--pairs", "1", "--request-timeout", "60",
        "--hostile-timeout", "60"]
MAX_LEN = 128


def check_consistent(data: dict, clients: int, requests: int, pairs: int, names: str = "ABC") -> None:
    phases = data["phases"]
    assert [(p["pair"], p["phase"]) for p in phases] == [(i, x) for i in range(pairs) for x in names]
    for p in phases:
        assert p["requests"] == p["sent"] == clients * requests
        assert p["completed"] == p["correct"] == p["sent"] and p["outcomes"] == {"200": p["sent"]}
        assert p["p50_ms"] <= p["p99_ms"]
        assert p["completed_per_s"] == pytest.approx(p["completed"] / p["wall_s"])
        assert (p["extra_client_requests"] > 0) == (p["phase"] != "A")
        assert p["server"]["alive"] and p["server"]["health"] == 200
        assert p["server"]["num_running"] == p["server"]["num_waiting"] == p["server"]["leaked_blocks"] == 0
    summary = data["summary"]
    assert summary["totals"] == {name: {k: pairs * clients * requests for k in ("requests", "sent", "completed",
                                                                                "correct")} for name in names}
    by_phase = {(p["pair"], p["phase"]): p for p in phases}
    assert list(summary["ratios"]) == (["B/A", "C/A", "B/C"] if "C" in names else ["B/A"])
    for which, ratios in summary["ratios"].items():
        num, den = which.split("/")
        for key, r in ratios.items():
            expected = [by_phase[i, num][key] / by_phase[i, den][key] for i in range(pairs)]
            assert r["per_pair"] == pytest.approx(expected)
            assert r["median"] == pytest.approx(statistics.median(expected))
            assert r["min"] <= r["median"] <= r["max"]
    cases = data["hostile_cases"]
    assert list(cases) == [c.name for c in build_cases(data["max_model_len"])]
    in_b = sum(p["extra_client_requests"] for p in phases if p["phase"] == "B")
    assert sum(sum(c["outcomes"].values()) for c in cases.values()) == in_b
    for name, case in cases.items():
        assert sum(case["outcomes"].values()) >= pairs, name  # every B phase sent every case at least once
        accepted = {o for o in case["outcomes"] if (o[0] + "xx" if o.isdigit() else o) in case["accept"]}
        assert case["failures"] == sum(v for o, v in case["outcomes"].items() if o not in accepted), name
    assert summary["hostile_failures"] == sum(c["failures"] for c in cases.values())
    if "C" in names:  # the control client: only valid requests, every one answered 200
        in_c = sum(p["extra_client_requests"] for p in phases if p["phase"] == "C")
        assert data["control_case"] == {"outcomes": {"200": in_c}, "failures": 0}
    else:
        assert data["control_case"] is None


def test_hostile_benchmark_against_a_live_server(tmp_path, capsys):
    model = tiny_model(max_len=MAX_LEN)
    out = tmp_path / "hostile.json"
    with live_server(engine(model, num_blocks=256, block_size=8)) as (url, _, _):
        assert main([*TINY, "--url", url, "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    check_consistent(data, clients=2, requests=3, pairs=1)
    assert data["max_model_len"] == MAX_LEN and data["server_log"] is None
    # the reference texts: an independent full-recompute greedy decode of the same model (eos ignored)
    for prompt, text in data["expected_texts"].items():
        tokens = reference_greedy(model, TOKENIZER.encode(prompt), 4, eos=-1)
        assert text == TOKENIZER.decode(tokens), prompt
    # the hardened server: every hostile case got an accepted answer, the 4 MB prompt a 400, the 9 MB body a 413
    assert {name: c["failures"] for name, c in data["hostile_cases"].items() if c["failures"]} == {}
    assert set(data["hostile_cases"]["9 MB body"]["outcomes"]) == {"413"}
    assert set(data["hostile_cases"]["unknown model"]["outcomes"]) == {"404"}
    assert data["git"]["commit"] is None or isinstance(data["git"]["commit"], str)
    printed = capsys.readouterr().out
    assert "B/C, median over pairs" in printed and f"wrote {out}" in printed


def test_a_server_answering_500_fails_every_case():
    def handler(request):
        return httpx.Response(500, json={"error": {"message": "boom"}})

    async def one_round():
        cases = build_cases(MAX_LEN)
        records = {c.name: CaseRecord(sorted(c.accept)) for c in cases}
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(handler)) as client:
            ctx = HostileContext(client, 5.0, {}, 4, 8)
            sent = await hostile_loop(ctx, cases, records, lambda: True, min_rounds=1)  # one round
        return cases, records, sent

    cases, records, sent = asyncio.run(one_round())
    assert sent == sum(sum(r.outcomes.values()) for r in records.values()) == len(cases) + 1  # the shared-id pair
    for c in cases:
        assert set(records[c.name].outcomes) == {"500"} and records[c.name].failures >= 1, c.name


def test_outcomes_are_classified():
    shaped = httpx.Response(400, json={"error": {"message": "bad seed", "type": "invalid_request_error"}})
    assert status_outcome(shaped) == "400"
    assert status_outcome(httpx.Response(422, json={"detail": "fastapi's shape"})) == "4xx-unshaped"
    assert status_outcome(httpx.Response(400, text="not json")) == "4xx-unshaped"
    assert status_outcome(httpx.Response(200, json={"choices": []})) == "200"
    record = CaseRecord(["4xx"])
    for outcome in ("400", "404", "500", "timeout", "4xx-unshaped", "400"):
        record.add(outcome)
    assert record.outcomes == {"400": 2, "404": 1, "500": 1, "timeout": 1, "4xx-unshaped": 1}
    assert record.failures == 3


def test_bad_flags_are_refused():
    with pytest.raises(SystemExit, match="--clients"):
        parse_args(["--clients", "0"])
    with pytest.raises(SystemExit, match="--url"):
        parse_args(["--url", "http://example.com:8000"])
    with pytest.raises(SystemExit, match="--max-len"):
        parse_args(["--max-len", "40"])
    assert parse_args(["--url", "http://127.0.0.1:8000/"]).url == "http://127.0.0.1:8000"


@pytest.mark.slow  # starts `meshtron serve` in a second interpreter (tens of seconds on a busy machine)
def test_hostile_benchmark_starts_and_stops_its_own_server(tmp_path):
    out = tmp_path / "hostile.json"
    assert main(["--clients", "2", "--requests", "2", "--max-tokens", "4", "--pairs", "1", "--hidden-size", "32",
                 "--layers", "1", "--ffn", "64", "--max-len", "128", "--no-control",
                 "--server-args=--max-body-bytes 1048576", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    check_consistent(data, clients=2, requests=2, pairs=1, names="AB")
    # the flag reached the server: the 4 MB prompt is now over the body limit (413), not a long prompt (400)
    assert set(data["hostile_cases"]["4 MB prompt"]["outcomes"]) == {"413"}
    assert data["server_exit_code"] == 0  # SIGTERM drained cleanly
    assert data["server_log"]["tracebacks"] == 0 and data["summary"]["hostile_failures"] == 0
    assert all(p["server"]["rss_mib"] > 0 for p in data["phases"])


def test_the_cli_hands_its_arguments_to_the_benchmark():
    from meshtron.cli import main as cli_main

    with pytest.raises(SystemExit, match="--clients: 0 must be >= 1"):
        cli_main(["bench", "hostile", "--clients", "0"])
