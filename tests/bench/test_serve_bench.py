"""benchmarks/serve.py runs end to end on a tiny workload and writes every JSON field: token counts
equal the drawn output lengths, the engine's greedy tokens equal the naive loop's (and transformers'
static batches' in the slow test), each system ran --repeats times, and the batch-1 decode columns
say n/a on a CPU."""

from __future__ import annotations

import json
import statistics

import numpy as np
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


DECODE_TINY = ["--mode", "decode", "--layers", "2", "--hidden-size", "64", "--heads", "4", "--kv-heads", "2",
               "--ffn", "96", "--vocab", "300", "--max-len", "64", "--prompt-len", "8", "--decode-tokens", "12",
               "--repeats", "3", "--bandwidth-mb", "32"]


def decode_closed_form(layers=2, h=64, heads=4, kv=2, ffn=96, vocab=300, prompt=8, n=12) -> tuple[int, int, float]:
    """(linear weight bytes, weight bytes without the embedding, mean key/value bytes) of DECODE_TINY in fp32."""
    hd = h // heads
    linear = layers * (2 * h * h + 2 * h * kv * hd + 3 * h * ffn) + vocab * h
    weights = linear + layers * 2 * h + h  # two norms per layer and the final norm
    contexts = [prompt + j + 1 for j in range(1, n)]  # keys attended by each timed step
    kv_mean = layers * 2 * kv * hd * 4 * sum(contexts) / len(contexts)
    return 4 * linear, 4 * weights, kv_mean


def test_decode_mode_bytes_and_ratios(tmp_path, capsys):
    """Bytes per step against the closed form from the shape; each fraction recomputed from the raw per-repeat
    rates, bandwidths and GEMV times in the JSON; a missing MTP checkpoint is a row saying why."""
    out = tmp_path / "decode.json"
    missing = tmp_path / "no-such-checkpoint"
    assert main([*DECODE_TINY, "--skip", "transformers", "--mtp-checkpoint", str(missing), "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    linear, weights, kv_mean = decode_closed_form()
    lim = data["limits"]["random"]
    assert lim["linear_bytes"] == linear and lim["weight_bytes"] == weights
    assert lim["kv_bytes_mean"] == pytest.approx(kv_mean) and lim["per_step"] == pytest.approx(weights + kv_mean)
    rounds = data["rounds"]
    assert len(rounds) == 3 and all(r["bandwidth_gbps"] > 0 and r["gemv_s"] > 0 for r in rounds)
    rows = {r["system"]: r for r in data["rows"]}
    fp32 = rows["meshtron fp32"]
    assert len(fp32["rates"]) == 3 and fp32["tok_per_s"] == pytest.approx(statistics.median(fp32["rates"]))
    per_step = weights + kv_mean
    assert fp32["of_bandwidth_limit"] == pytest.approx(statistics.median(
        rate * per_step / (r["bandwidth_gbps"] * 1e9) for rate, r in zip(fp32["rates"], rounds)))
    assert fp32["of_gemv_ceiling"] == pytest.approx(statistics.median(
        rate * per_step * r["gemv_s"] / linear for rate, r in zip(fp32["rates"], rounds)))
    passes = [t for r in rounds for t in r["gemv_passes_s"]]
    assert all(r["gemv_s"] == statistics.median(r["gemv_passes_s"]) for r in rounds)
    assert fp32["of_gemv_ceiling_p10"] == pytest.approx(
        per_step * float(np.percentile(passes, 10)) / (linear * fp32["token_p10_s"]))
    spec = next(r for name, r in rows.items() if name.startswith("meshtron speculative"))
    assert spec["tok_per_s"] is None and "not available" in spec["note"] and str(missing) in spec["note"]
    int8 = rows["meshtron int8 weight-only"]
    if int8["tok_per_s"] is not None:  # torchao installed: int8 linear weights plus fp32 per-row scales
        assert int8["bytes_per_step"] < per_step / 2 and 0 <= int8["token_agreement"] <= 1
        assert int8["x_fp32"] == pytest.approx(statistics.median(
            a / b for a, b in zip(int8["rates"], fp32["rates"])))
    assert set(data["goals"]) == {"fp32_of_gemv_ceiling", "int8_over_fp32", "speculative_over_fp32"}
    assert data["goals"]["fp32_of_gemv_ceiling"]["value"] == fp32["of_gemv_ceiling"]
    printed = capsys.readouterr().out
    assert "memory-read bandwidth" in printed and "not available" in printed


def test_decode_mode_refuses_bad_flags(tmp_path):
    with pytest.raises(SystemExit, match="--max-len"):
        main([*DECODE_TINY, "--decode-tokens", "100", "--output", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="--kv-heads"):
        main([*DECODE_TINY, "--kv-heads", "3", "--output", str(tmp_path / "x.json")])


@pytest.mark.slow  # converts to transformers and saves an MTP checkpoint
def test_decode_mode_same_tokens_as_transformers_and_speculative(tmp_path):
    """transformers' greedy tokens on the converted weights equal the engine's; speculative decoding from an
    (untrained) MTP depth gives the tokens of the same checkpoint decoded without it."""
    pytest.importorskip("transformers")
    import yaml

    from meshtron.checkpoint import CheckpointManager
    from meshtron.config.loader import config_to_dict
    from meshtron.config.schema import ModelConfig, RunConfig
    from meshtron.inference.config import EngineConfig
    from meshtron.models import GPTModel

    args = [*DECODE_TINY, "--skip", "int8", "--output", str(tmp_path / "decode.json")]
    if "speculative_method" in EngineConfig.__dataclass_fields__:
        cfg = RunConfig(model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                                          max_position_embeddings=64, mtp_num_layers=1))
        cfg.tokenizer.type = "byte"
        model = GPTModel(cfg.model, 262)
        CheckpointManager(tmp_path / "mtp").save(0, model, None, {"step": 0}, yaml.safe_dump(config_to_dict(cfg)))
        args += ["--mtp-checkpoint", str(tmp_path / "mtp")]
    else:
        args += ["--skip", "int8", "speculative"]
    assert main(args) == 0
    rows = {r["system"]: r for r in json.loads((tmp_path / "decode.json").read_text())["rows"]}
    assert rows["transformers fp32"]["same_tokens"] is True
    spec = [r for name, r in rows.items() if name.startswith("meshtron speculative")]
    if spec:
        assert spec[0]["same_tokens"] is True, spec[0]
