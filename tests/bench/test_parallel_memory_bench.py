"""The parallel memory benchmark end to end on a tiny model: the JSON fields, the plan next to the
measurement per stage, and measured values that follow from the layout (never timings)."""

from __future__ import annotations

import json

import pytest

from meshtron.bench.parallel_memory import LAYOUTS, MEASURED, main

TINY = ["--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
        "--model.ffn_hidden_size", "64", "--model.max_position_embeddings", "32", "--data.seq_length", "32"]


def run_bench(tmp_path, layouts: str) -> dict:
    out = tmp_path / "parallel_memory.json"
    assert main(["--layouts", layouts, "--steps", "1", "--warmup", "0", "--timeout", "240", "--output", str(out),
                 *TINY]) == 0
    return json.loads(out.read_text())


def test_parallel_memory_benchmark_writes_json(tmp_path):
    data = run_bench(tmp_path, "single,fsdp2")
    assert data["benchmark"] == "parallel_memory" and data["num_params"] > 0
    assert [e["layout"] for e in data["layouts"]] == ["single", "fsdp2"]
    by_name = {e["layout"]: e for e in data["layouts"]}
    for e in data["layouts"]:
        assert e["note"] is None, e["note"]
        assert e["world_size"] == LAYOUTS[e["layout"]][0] == len(e["ranks"])
        assert e["step_s"] > 0 and e["best_step_s"] <= e["step_s"]
        assert sorted(e["measured"]) == sorted(str(p["stage"]) for p in e["plan"])
        for row in e["measured"].values():
            assert set(MEASURED) <= set(row) and all(row[k] > 0 for k in MEASURED)
    single, fsdp2 = by_name["single"]["measured"]["0"], by_name["fsdp2"]["measured"]["0"]
    # FSDP2 keeps half of every parameter (the larger half where a dim 0 is odd) and of Adam's two states
    assert fsdp2["param_bytes"] == pytest.approx(single["param_bytes"] / 2, rel=0.05)
    assert fsdp2["optimizer_bytes"] == pytest.approx(single["optimizer_bytes"] / 2, rel=0.05)
    # the plan (meta device, no allocation) gives the same parameter bytes as the measurement
    assert by_name["single"]["plan"][0]["param_bytes"] == single["param_bytes"]


@pytest.mark.slow
def test_parallel_memory_benchmark_pipeline_layouts(tmp_path):
    data = run_bench(tmp_path, "pp2,pp2_interleaved,tp2_pp2,pp2_fsdp2")
    for e in data["layouts"]:
        assert e["note"] is None, e["note"]
        assert sorted(e["measured"]) == ["0", "1"]  # per pp rank (interleaved: both its virtual stages)
        assert all(row["param_bytes"] > 0 for row in e["measured"].values())
