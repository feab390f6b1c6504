"""benchmarks/megatron_convert.py on a tiny shape: the JSON it writes (model size in closed form, one
median per direction, every run recorded), never the timings themselves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "megatron_convert.py"


def load_script():
    spec = importlib.util.spec_from_file_location("megatron_convert_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # megatron-core builds and saves a model, then two fresh conversion processes (~40 s)
def test_megatron_convert_benchmark_writes_json(tmp_path):
    pytest.importorskip("megatron.core")
    bench = load_script()
    out = tmp_path / "megatron_convert.json"
    h, layers, ffn, vocab = 32, 2, 48, 64
    assert bench.main(["--hidden-size", str(h), "--layers", str(layers), "--heads", "4", "--ffn", str(ffn),
                       "--vocab", str(vocab), "--repeats", "1", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    params = 2 * vocab * h + layers * (2 * h + 4 * h * h + 3 * ffn * h) + h  # embedding + head, blocks, final norm
    assert report["model"]["parameters"] == params and report["model"]["bytes"] == 4 * params
    assert report["model"]["largest_tensor_bytes"] == 4 * max(vocab * h, 2 * ffn * h, 3 * h * h)
    assert report["model"]["largest_stacked_tensor_bytes"] == 4 * layers * max(2 * ffn * h, 3 * h * h)
    assert list(report["summary"]) == list(bench.MODES) and set(report["runs"]) == set(bench.MODES)
    for mode in bench.MODES:
        (run,) = report["runs"][mode]
        assert run["seconds"] > 0 and run["peak_rss_bytes"] >= run["start_rss_bytes"] > 0
        row = report["summary"][mode]
        assert row["seconds"] == run["seconds"]
        assert row["peak_rss_above_start_bytes"] == run["peak_rss_bytes"] - run["start_rss_bytes"]
