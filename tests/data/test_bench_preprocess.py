"""Smoke run of the preprocess benchmark on a few stdlib files: the JSON has every field, the three
sides tokenised the same number of tokens, and the ratios are the rates divided."""

from __future__ import annotations

import json

import pytest

from meshtron.data.bench_preprocess import main


def test_bench_preprocess_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--workers", "1", "--repeats", "1", "--max-documents", "8", "--vocab-size", "400",
                 "--index-tokens", "5000", "--seq-lengths", "16", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["workers"] == 1 and r["repeats"] == 1 and r["max_documents"] == 8 and r["corpus_bytes"] > 0
    sides = ("encode_batch", "encode_batch_fast", "meshtron")
    assert set(r["runs"]) == set(sides) == set(r["tokens_per_s"])
    counts = {name: runs[0]["num_tokens"] for name, runs in r["runs"].items()}
    assert counts["meshtron"] > 0 and len(set(counts.values())) == 1   # the same text, the same tokens
    for name in sides:
        best = min(r["runs"][name], key=lambda x: x["seconds"])
        assert r["tokens_per_s"][name] == pytest.approx(best["num_tokens"] / best["seconds"])
    for base in ("encode_batch", "encode_batch_fast"):
        ratio = r[f"ratio_vs_{base}"]
        assert ratio > 0 and ratio == pytest.approx(r["tokens_per_s"]["meshtron"] / r["tokens_per_s"][base])
    (index,) = r["index_build"]
    assert index["num_tokens"] == 5000 and index["seq_length"] == 16
    assert index["num_samples"] == (5000 - 1) // 16
    table = capsys.readouterr().out
    assert "vs encode_batch_fast" in table and "meshtron preprocess" in table
