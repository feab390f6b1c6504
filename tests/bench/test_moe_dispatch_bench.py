"""The expert-parallel dispatcher benchmark on 2 gloo ranks, tiny shape: its rows and their
definitions (never timings: those depend on the machine)."""

from __future__ import annotations

import json

import pytest

from meshtron.bench.moe import main


def test_ep_dispatch_rows_in_the_moe_benchmark(tmp_path):
    out = tmp_path / "moe.json"
    assert main(["--hidden-size", "16", "--expert-ffn", "32", "--num-experts", "4", "--topk", "2", "--batch-size", "2",
                 "--seq-length", "8", "--repeats", "2", "--iters", "1", "--warmup", "1", "--device", "cpu",
                 "--ep-sizes", "2", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["ep_dispatch"]
    assert [(r["ep"], r["dispatcher"]) for r in rows] == [(2, "local"), (2, "allgather"), (2, "alltoall")]
    local, allgather, alltoall = rows
    assert local["forward_vs_local"] == local["train_vs_local"] == 1.0
    for r in rows:
        assert r["tokens_per_rank"] == 16
        assert r["forward_vs_local"] == pytest.approx(r["forward_ns_per_token"] / local["forward_ns_per_token"])
    # all-gather sends every token to the other rank; all-to-all only the choices of the other rank's experts
    assert local["rows_sent_per_rank"] == 0 and allgather["rows_sent_per_rank"] == 16
    assert 0 < alltoall["rows_sent_per_rank"] < 16 * 2


def test_dispatch_timing_waits_for_the_gpu(monkeypatch):
    """On CUDA the timed window starts after, and ends after, a device synchronisation (kernels run
    asynchronously: without it the window measures their launch); on CPU there is nothing to wait for."""
    import torch

    from meshtron.bench.moe_dispatch import timed

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}"))
    timed(lambda: events.append("call"), 2, torch.device("cuda", 0), lambda: events.append("barrier"))
    assert events == ["sync cuda:0", "barrier", "call", "call", "sync cuda:0"]
    events.clear()
    timed(lambda: events.append("call"), 1, torch.device("cpu"), lambda: events.append("barrier"))
    assert events == ["barrier", "call"]
