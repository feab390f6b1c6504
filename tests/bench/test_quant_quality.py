"""benchmarks/quant_quality.py on a random-weight checkpoint: its int8 row equals what the test computes
itself, with torchao applied directly, cross-entropy per token on the same held-out windows, and
full-recompute greedy loops (no engine) for the continuations."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao is not installed (pip install meshtron[quant])")


def test_int8_row_matches_an_independent_computation(tmp_path):
    from meshtron.bench.quant_quality import held_out_windows, main
    from meshtron.inference.loading import load_model_and_tokenizer
    from meshtron.nn.torchao import import_torchao
    from tests.inference.helpers import reference_greedy, save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "ck")
    out = tmp_path / "q.json"
    assert main(["--checkpoint", checkpoint, "--modes", "int8-weight-only", "--windows", "3", "--prompts", "2",
                 "--prompt-tokens", "8", "--new-tokens", "6", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    row = result["rows"]["int8-weight-only"]

    fp32, tokenizer, _ = load_model_and_tokenizer(checkpoint, "cpu")
    import_torchao()
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quant = copy.deepcopy(fp32)
    quantize_(quant, Int8WeightOnlyConfig())
    windows = held_out_windows(checkpoint, tokenizer, 3, fp32.cfg.max_position_embeddings)
    assert result["held_out_tokens"] == windows[:, 1:].numel()
    with torch.no_grad():
        def nll(model):
            logits = model(windows[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none")
        ref, got = nll(fp32), nll(quant)
        top1 = (fp32(windows[:, :-1]).argmax(-1) == quant(windows[:, :-1]).argmax(-1)).float().mean()
    assert row["mean_abs_logprob_delta"] == pytest.approx(float((got - ref).abs().mean()), rel=1e-4, abs=1e-7)
    assert row["mean_logprob_delta"] == pytest.approx(float((ref - got).mean()), rel=1e-3, abs=1e-6)
    assert result["rows"]["fp32"]["perplexity"] == pytest.approx(float(torch.exp(ref.mean())), rel=1e-5)
    assert row["top1_agreement"] == pytest.approx(float(top1))
    agreed = 0
    for prompt in windows[:2, :8].tolist():
        a, b = reference_greedy(fp32, prompt, 6, eos=-1), reference_greedy(quant, prompt, 6, eos=-1)
        agreed += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 6)
    assert row["greedy_prefix_agreement"] == pytest.approx(agreed / 12)
    assert 0 < row["linear_weight_mb"] < result["rows"]["fp32"]["linear_weight_mb"] / 3   # int8 + a scale per row
