"""The hybrid Mamba benchmark: the models it compares have (nearly) equal parameters and the intended
patterns, and a tiny run writes the JSON with every measurement (never timings: machine-dependent)."""

from __future__ import annotations

import json

import pytest

from meshtron.bench.mamba import VOCAB, main, model_configs, parse_args
from meshtron.models import count_parameters


def test_compared_models_have_equal_parameters():
    cfgs = model_configs(parse_args([]))
    assert cfgs["hybrid"].pattern == "M-MM*M-M" and cfgs["attention"].pattern == "*-" * 4
    assert set(cfgs["mamba"].pattern) == {"M"}
    sizes = {name: count_parameters(cfg, VOCAB) for name, cfg in cfgs.items()}
    assert abs(sizes["attention"] / sizes["hybrid"] - 1) < 0.001  # the MLP width is solved to match
    assert abs(sizes["mamba"] / sizes["hybrid"] - 1) < 0.05  # whole Mamba layers: the nearest count


@pytest.mark.slow
def test_tiny_run_writes_every_measurement(tmp_path):
    out = tmp_path / "mamba.json"
    args = ["--train-lengths", "64,128", "--decode-lengths", "32,64", "--tokens-per-step", "128", "--steps", "1",
            "--decode-steps", "2", "--hidden-size", "64", "--chunk-size", "16", "--mamba-state", "16",
            "--output", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert [(r["model"], r["seq_length"]) for r in data["train"]] == [
        ("hybrid", 64), ("attention", 64), ("hybrid", 128), ("attention", 128)]
    assert all(r["tokens_per_s"] > 0 and r["batch"] * r["seq_length"] >= 128 for r in data["train"])
    assert {(r["model"], r["context"]) for r in data["decode"]} == {
        (m, n) for m in ("hybrid", "attention", "mamba") for n in (32, 64)}
    assert set(data["summary"]["train_hybrid_over_attention"]) == {"64", "128"}
