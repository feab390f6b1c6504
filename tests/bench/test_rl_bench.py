"""The GRPO benchmark end to end on a tiny recipe: one step (the step that used to leave nothing to
take the median of), the JSON structure and the ratios' definitions (never timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.bench.rl import main

TINY = """
model: {num_layers: 1, hidden_size: 32, num_attention_heads: 4, ffn_hidden_size: 64, max_position_embeddings: 64,
        make_vocab_size_divisible_by: 1}
data: {seq_length: 32}
train: {micro_batch_size: 4, seed: 3, num_threads: 1}
tokenizer: {type: byte}
logger: {progress_bar: "off"}
rl: {prompts_per_step: 2, group_size: 2, max_new_tokens: 4, pack_length: 64, warmup_batch_size: 4,
     engine_kv_cache_memory_mb: 4}
env: {names: [countdown], countdown_num_numbers: 2, countdown_max_number: 5}
"""


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_rl_benchmark_one_step_writes_json(tmp_path, capsys, one_thread):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "rl.json"
    assert main(["--config", str(config), "--steps", "1", "--warmup-steps", "1", "--naive-prompts", "1",
                 "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["measured_steps"] == 1 and r["prompts_per_step"] == 2 and r["group_size"] == 2
    assert 0 < r["generation_share"] < 1
    e = r["engine_vs_naive_rollouts"]
    assert e["prompts"] == 1 and e["ratio"] == pytest.approx(e["engine_tokens_per_s"] / e["naive_tokens_per_s"])
    p = r["packed_vs_padded_training"]
    assert p["ratio"] == pytest.approx(p["packed"] / p["padded"])
    assert p["packed_rows"] == 1 and p["padded_rows"] == 2  # two short rollouts share one 64-token row
    assert "share of step time in generation" in capsys.readouterr().out


def test_rl_benchmark_script_refuses_zero_steps():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "rl.py"
    proc = subprocess.run([sys.executable, str(script), "--steps", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--steps: 0 is not allowed; must be >= 1" in proc.stderr
