"""benchmarks/convert.py on a tiny Llama shape: the JSON it writes (model size in closed form, one
median per direction and mode, every run recorded), never the timings themselves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "convert.py"


def load_script():
    spec = importlib.util.spec_from_file_location("convert_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # four fresh conversion processes (~35 s on the 2-core machine)
def test_convert_benchmark_writes_json(tmp_path):
    bench = load_script()
    out = tmp_path / "convert.json"
    h, layers, ffn, vocab = 16, 2, 24, 40
    assert bench.main(["--hidden-size", str(h), "--layers", str(layers), "--heads", "2", "--ffn", str(ffn),
                       "--vocab", str(vocab), "--repeats", "1", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    params = 2 * vocab * h + layers * (2 * h + 4 * h * h + 3 * ffn * h) + h  # embedding + head, blocks, final norm
    assert report["model"]["parameters"] == params and report["model"]["bytes"] == 4 * params
    assert report["model"]["largest_tensor_bytes"] == 4 * max(vocab * h, ffn * h, h * h)
    assert (report["model"]["hidden_size"], report["model"]["layers"], report["repeats"]) == (h, layers, 1)
    assert list(report["summary"]) == list(bench.MODES) and set(report["runs"]) == set(bench.MODES)
    for mode in bench.MODES:
        (run,) = report["runs"][mode]
        assert run["seconds"] > 0 and run["peak_rss_bytes"] >= run["start_rss_bytes"] > 0
        row = report["summary"][mode]
        assert row["seconds"] == run["seconds"]
        assert row["peak_rss_above_start_bytes"] == run["peak_rss_bytes"] - run["start_rss_bytes"]
