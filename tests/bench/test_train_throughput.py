"""The throughput benchmark end to end on a tiny shape: JSON structure and equal parameter counts
(never timings: those depend on the machine)."""

from __future__ import annotations

import json

import pytest

from meshtron.bench.train_throughput import main
from meshtron.config import config_from_dict
from meshtron.models import count_parameters

TINY_ARGS = [  # every knob the run depends on, so a change to the configs/ files cannot break this test
    "--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
    "--model.num_query_groups", "2", "--model.ffn_hidden_size", "64", "--data.seq_length", "32",
    "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
    "--device", "cpu", "--peak-flops", "1e11", "--repeats", "1", "--warmup", "1", "--steps", "1",
]


def test_benchmark_writes_json_with_matching_parameter_counts(tmp_path):
    config, out = tmp_path / "bytes.yaml", tmp_path / "bench.json"
    config.write_text("tokenizer:\n  type: byte\n")  # raw stdlib sources: no data preparation
    assert main([*TINY_ARGS, "--config", str(config), "--output", str(out)]) == 0
    data = json.loads(out.read_text())

    model_cfg = config_from_dict(data["config"]).model
    expected = count_parameters(model_cfg, 262)  # byte tokenizer: 256 bytes + 6 specials, padded to 384
    assert data["num_params"] == {"meshtron": expected, "plain": expected}

    assert data["settings"]["repeats"] == 1 and data["settings"]["steps"] == 1
    assert data["settings"]["tokens_per_step"] == 4 * 32
    assert data["config"]["model"]["hidden_size"] == 32
    assert sorted(r["impl"] for r in data["runs"]) == ["meshtron", "plain"]
    for run in data["runs"]:
        assert {"tokens_per_s", "mfu", "step_ms", "seconds", "last_loss"} <= set(run)
        assert run["tokens_per_s"] > 0
    assert set(data["median"]) == {"meshtron", "plain"}
    assert len(data["ratio"]["per_repeat"]) == 1
    assert data["ratio"]["median"] == data["ratio"]["per_repeat"][0]
    # Same weights and the same function: only rounding may differ.
    assert data["initial_loss"]["plain"] == pytest.approx(data["initial_loss"]["meshtron"], rel=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps: 0 is not allowed"),
    (["--model.qk_layernorm", "true"], "model.qk_layernorm: True is not supported by the plain baseline"),
])
def test_bad_input_exits_2_before_training(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err
