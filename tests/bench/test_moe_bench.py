"""The MoE benchmark end to end on a tiny shape: JSON structure and the ratios' definition (never
timings: those depend on the machine)."""

from __future__ import annotations

import json

import pytest

from meshtron.bench.moe import main


def test_moe_benchmark_writes_json(tmp_path):
    out = tmp_path / "moe.json"
    assert main(["--hidden-size", "16", "--expert-ffn", "32", "--num-experts", "4", "--topk", "2", "--batch-size", "2",
                 "--seq-length", "8", "--repeats", "1", "--iters", "1", "--warmup", "1", "--device", "cpu",
                 "--ep-sizes", "", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [c["case"] for c in data["cases"]] == ["dense", "moe grouped", "moe looped"]
    dense = data["cases"][0]
    assert dense["train_vs_dense"] == 1.0 and dense["forward_vs_dense"] == 1.0
    for case in data["cases"]:
        assert case["train_tokens_per_s"] == pytest.approx(16 / (case["train_ms"] / 1e3))
    assert set(data["per_token_ns"]) == {"router", "routing map", "dispatch+combine (local)"}
    assert data["settings"]["num_tokens"] == 16 and data["settings"]["grouped_mm"] is True
    assert "ep_dispatch" not in data  # tests/bench/test_moe_dispatch_bench.py runs the ranks
