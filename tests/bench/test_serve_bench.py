"""benchmarks/serve.py runs end to end on a tiny workload and writes every JSON field: token counts
equal the drawn output lengths, the engine's greedy tokens equal the naive loop's (and transformers'
static batches' in the slow test), each system ran --repeats times, and the batch-1 decode columns
say n/a on a CPU."""

from __future__ import annotations

import json

import pytest

from meshtron.bench.serve import build_workload, main

TINY = ["--num-requests", "6", "--prompt-len", "4", "12", "--output-len", "2", "6", "--batch-size", "4",
        "--engine-max-num-seqs", "8", "--hidden-size", "32", "--layers", "2", "--heads", "4", "--ffn", "64",
        "--max-len", "32", "--device", "cpu"]


def run(tmp_path, *extra: str) -> dict:
    out = tmp_path / "serve.json"
    assert main([*TINY, *extra, "--output", str(out)]) == 0
    return json.loads(out.read_text())


def test_serve_benchmark_json_fields(tmp_path, capsys):
    data = run(tmp_path, "--repeats", "2", "--skip", "static")
    _, outputs = build_workload(6, 0, (4, 12), (2, 6))
    names = [r["system"] for r in data["results"]]
    assert names == ["meshtron engine s=4", "meshtron engine s=8", "naive one-at-a-time"]
    # no flag: the default engine, which on a CPU decodes with the native kernel
    assert [r.get("decode_attention") for r in data["results"]] == ["native", "native", None]
    assert data["args"]["decode_attention"] == ["auto"] and data["args"]["pairs"] == 3
    for r in data["results"]:
        assert r["num_requests"] == 6 and r["output_tokens"] == sum(outputs)
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["output_tokens_per_cpu_s"] == pytest.approx(r["output_tokens"] / r["cpu_s"])
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tpot_p50_ms"] <= r["tpot_p99_ms"]
        walls = data["walls_s"][r["system"]]
        assert len(walls) == 2 and r["wall_s"] == min(walls)  # lower middle of two runs
    assert data["summary"]["greedy_agreement_engine_naive"] == 1.0
    assert data["summary"]["engine_over_naive"] == pytest.approx(
        data["results"][0]["output_tokens_per_s"] / data["results"][2]["output_tokens_per_s"])
    (decode,) = data["decode_batch1"]
    assert decode["cuda_graphs"] == "n/a" and decode["decode_tokens_per_s"] is None
    assert decode["bandwidth_limit_tokens_per_s"] is None and "n/a" in decode["note"]
    assert data["args"]["device"] == "cpu" and data["date"]
    printed = capsys.readouterr().out
    assert "tok/s n/a" in printed and "engine / naive throughput" in printed


def test_forced_decode_attention_rows(tmp_path, capsys):
    data = run(tmp_path, "--skip", "static", "naive", "decode", "--decode-attention", "gather", "native")
    assert [r["system"] for r in data["results"]] == ["meshtron engine s=4 gather", "meshtron engine s=8 gather",
                                                      "meshtron engine s=4 native", "meshtron engine s=8 native"]
    assert [r["decode_attention"] for r in data["results"]] == ["gather", "gather", "native", "native"]
    assert "greedy tokens differ" not in capsys.readouterr().out


def test_serve_benchmark_refuses_bad_flags(tmp_path):
    with pytest.raises(SystemExit, match="--max-len"):
        main([*TINY, "--max-len", "16", "--output", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="--repeats"):
        main([*TINY, "--repeats", "0", "--output", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="--pairs"):
        main([*TINY, "--pairs", "-1", "--output", str(tmp_path / "x.json")])


@pytest.mark.slow  # saves a checkpoint, converts it and loads it into transformers
def test_serve_benchmark_static_batches_agree(tmp_path):
    pytest.importorskip("transformers")
    data = run(tmp_path, "--skip", "naive", "decode", "--pairs", "2")
    assert [r["system"] for r in data["results"]][-1] == "transformers static b=4"
    assert data["summary"]["greedy_agreement_engine_static"] == 1.0
    assert [p["engine"] for p in data["pairs"]] == ["s=8", "s=8"]  # the largest concurrency, the default engine
    for p in data["pairs"]:
        assert p["ratio"] == pytest.approx(p["static_wall_s"] / p["engine_wall_s"])
        assert p["cpu_ratio"] == pytest.approx(p["static_cpu_s"] / p["engine_cpu_s"])
    paired = data["summary"]["paired_engine_over_static"]
    assert paired["median"] == pytest.approx(sum(p["ratio"] for p in data["pairs"]) / 2)
    assert paired["cpu_median"] == pytest.approx(sum(p["cpu_ratio"] for p in data["pairs"]) / 2)
    assert paired["min"] <= paired["median"] <= paired["max"]
    assert data["decode_batch1"] == []
    assert data["summary"]["engine_over_static"] > 0 and data["summary"]["engine_over_static_cpu"] > 0
