"""The offload benchmark runs end to end on a tiny model and accounts the Adam states exactly
(2 fp32 moments per parameter, on the device at fraction 0 and on the host at fraction 1)."""

from __future__ import annotations

import json

import pytest

from meshtron.bench.offload import main


@pytest.mark.slow  # two fresh interpreters that import torch and build the stdlib corpus
def test_offload_benchmark_accounts_the_states(tmp_path, capsys):
    out = tmp_path / "offload.json"
    rc = main(["--fractions", "0,1", "--steps", "1", "--warmup", "0", "--output", str(out),
               "--model.num_layers", "1", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
               "--model.ffn_hidden_size", "64", "--data.seq_length", "16", "--model.max_position_embeddings", "16"])
    assert rc == 0
    base, full = json.loads(out.read_text())["results"]
    moments = 2 * 4 * base["parameters"]
    assert (base["device_state_bytes"], base["host_state_bytes"]) == (moments, 0)
    assert (full["device_state_bytes"], full["host_state_bytes"]) == (0, moments)
    assert full["host_buffer_bytes"] == 2 * 4 * base["parameters"]   # host copy + gradient buffer
    assert "x base" in capsys.readouterr().out
