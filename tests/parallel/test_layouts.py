"""Every parallel layout trains the same model as one process: the losses of 3 optimizer steps and
the parameters afterwards match the single-process run (fp32, gloo, forked ranks)."""

from __future__ import annotations

import pytest
import torch

from meshtron.testing.multiprocess import run_ranks
from meshtron.training import Trainer

BASE = {
    "model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
    "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
    "model.make_vocab_size_divisible_by": "128", "data.seq_length": "32",
    "train.micro_batch_size": "2", "train.global_batch_size": "8", "train.train_iters": "3",
    "train.eval_interval": "0", "train.peak_flops": "1e11", "logger.progress_bar": "off",
    "scheduler.warmup_steps": "1", "checkpoint.save_at_end": "false", "optimizer.lr": "1e-3",
}

LAYOUTS = {
    "tp2": (2, {"parallel.tp": "2", "parallel.sequence_parallel": "false", "parallel.loss_parallel": "false"}),
    "tp2_sp": (2, {"parallel.tp": "2"}),
    "fsdp2": (2, {"parallel.dp_shard": "2"}),
    "fsdp4": (4, {"parallel.dp_shard": "4"}),
    "hsdp_2x2": (4, {"parallel.dp_replicate": "2", "parallel.dp_shard": "2"}),
    "tp2_fsdp2": (4, {"parallel.tp": "2", "parallel.dp_shard": "2"}),
    "tp2_sinks_window": (2, {"parallel.tp": "2", "model.softmax_type": "learnable", "model.window_size": "8"}),
}
DEFAULT = {"tp2_sp", "fsdp2", "tp2_fsdp2"}


MODEL_KEYS = ("model.",)


def single_process(tmp_path, extra):
    """Losses and parameters of the one-process run with the same model options as a layout."""
    from meshtron.config.loader import load_config

    model_extra = {k: v for k, v in extra.items() if k.startswith(MODEL_KEYS)}
    trainer = Trainer(load_config(overrides={**BASE, **model_extra, "train.run_dir": str(tmp_path)}, world_size=1))
    history = trainer.train()
    return [r.loss for r in history], {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return single_process(tmp_path_factory.mktemp("ref"), {})


def check_against_reference(results, reference):
    ref_losses, ref_params = reference
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5, rel=0)
    merged = {}
    for r in results:
        merged.update(r["params"])
    assert set(merged) == set(ref_params)
    for name, value in merged.items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k in DEFAULT else pytest.mark.slow) for k in LAYOUTS])
def test_layout_matches_single_process(layout, reference, tmp_path):
    world, extra = LAYOUTS[layout]
    overrides = {**BASE, **extra, "train.run_dir": str(tmp_path / "run"), "parallel.timeout_s": "60"}
    results = run_ranks("meshtron.testing.parity:train_and_report", world, timeout_s=240, overrides=overrides)
    has_model_options = any(k.startswith(MODEL_KEYS) for k in extra)
    check_against_reference(results, single_process(tmp_path / "ref", extra) if has_model_options else reference)
