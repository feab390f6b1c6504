"""`benchmarks/serve_parallel.py --mode pp` runs end to end on a tiny model: every pipeline variant
gives the single process's tokens, and the table's ratios are the medians' wall-time ratios."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_pp_mode_runs_and_the_pipeline_gives_the_single_process_tokens(tmp_path):
    from meshtron.bench.serve_parallel import main

    out = tmp_path / "sp.json"
    assert main(["--mode", "pp", "--num-requests", "4", "--prompt-len", "2", "8", "--output-len", "2", "6",
                 "--layers", "2", "--hidden-size", "32", "--heads", "2", "--repeats", "1", "--single-threads", "1",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())["pp"]
    assert result["same_tokens"]
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"single 1 thr", "pp2", "pp2 sync", "pp2 sync m=2"}
    single = rows["single 1 thr"]["walls"][0]
    for r in rows.values():
        assert r["vs_single"] == pytest.approx(single / r["walls"][0], rel=0.05)
        assert r["output_tokens_per_s"] == pytest.approx(result["output_tokens"] / r["walls"][0], rel=0.05)
