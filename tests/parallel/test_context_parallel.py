"""Context-parallel training equals the single-process run: the losses of 3 optimizer steps and the
parameters afterwards (fp32, gloo, forked ranks), with zig-zag and contiguous sharding, sliding
windows, learnable sinks, packed-document masks and restarted positions, and combined with TP."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshtron.config.loader import load_config
from meshtron.data.indexed import IndexedDatasetWriter
from meshtron.data.tokenizer import ByteTokenizer
from meshtron.testing.multiprocess import run_ranks
from meshtron.training import Trainer

from .test_layouts import BASE, check_against_reference

# Windowed layers (the second attention layer stays full), a sink logit per head, and attention that
# stops at document boundaries with positions restarting in each document (short documents: `short_docs`).
FEATURES = {"model.window_size": "5", "model.window_attn_skip_freq": "2", "model.softmax_type": "learnable",
            "data.reset_attention_mask": "true", "data.reset_position_ids": "true"}
WINDOW = {"model.window_size": "7"}

# name -> (world size, parallel overrides, model/data overrides shared with the reference)
LAYOUTS = {
    "cp2": (2, {"parallel.cp": "2"}, {}),
    "cp2_window_sinks_documents": (2, {"parallel.cp": "2"}, FEATURES),
    "cp2_contiguous": (2, {"parallel.cp": "2", "parallel.cp_load_balance": "false"}, FEATURES),
    "cp4": (4, {"parallel.cp": "4"}, FEATURES),
    "tp2_cp2": (4, {"parallel.tp": "2", "parallel.cp": "2"}, {}),
    "tp2_cp2_window": (4, {"parallel.tp": "2", "parallel.cp": "2"}, WINDOW),
    "cp2_fsdp2": (4, {"parallel.cp": "2", "parallel.dp_shard": "2"}, WINDOW),
    "cp2_recompute": (2, {"parallel.cp": "2", "parallel.activation_checkpoint": "full"}, FEATURES),
    "cp2_compile": (2, {"parallel.cp": "2", "parallel.compile": "true"}, WINDOW),
}
DEFAULT = {"cp2", "cp2_window_sinks_documents"}

_references: dict[tuple, tuple] = {}


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> str:
    """An indexed dataset of 3..15-token documents, so every 32-token sample packs several of them."""
    prefix = tmp_path_factory.mktemp("docs") / "short"
    rng = np.random.default_rng(0)
    tokenizer = ByteTokenizer()
    writer = IndexedDatasetWriter(prefix, tokenizer.vocab_size)
    for _ in range(600):  # each document ends with eod, which is where packed samples find the boundaries
        writer.add_document(np.append(rng.integers(0, 256, size=int(rng.integers(2, 15))), tokenizer.eod_id))
    writer.finalize()
    return str(prefix)


def reference(features: dict[str, str], run_dir) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process run with the same model and data (cached per feature set)."""
    key = tuple(sorted(features.items()))
    if key not in _references:
        trainer = Trainer(load_config(overrides={**BASE, **features, "train.run_dir": str(run_dir)}, world_size=1))
        history = trainer.train()
        _references[key] = ([r.loss for r in history],
                            {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    return _references[key]


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k in DEFAULT else pytest.mark.slow) for k in LAYOUTS])
def test_context_parallel_matches_single_process(layout, tmp_path, short_docs):
    world, parallel, features = LAYOUTS[layout]
    if features.get("data.reset_attention_mask") == "true":
        features = {**features, "data.paths": f"[{short_docs}]"}
    ref_losses, ref_params = reference(features, tmp_path / "ref")
    overrides = {**BASE, **features, **parallel, "train.run_dir": str(tmp_path / "run"), "parallel.timeout_s": "60"}
    results = run_ranks("meshtron.testing.parity:train_and_report", world, timeout_s=240, overrides=overrides)
    check_against_reference(results, (ref_losses, ref_params))


@pytest.mark.slow  # the refusal itself is checked by the default ring-attention test
def test_attention_dropout_is_refused_under_cp(tmp_path):
    overrides = {**BASE, "parallel.cp": "2", "model.attention_dropout": "0.1", "train.run_dir": str(tmp_path / "run"),
                 "parallel.timeout_s": "60"}
    results = run_ranks("meshtron.testing.parity:train_and_report", 2, timeout_s=120, allow_failures=True,
                        overrides=overrides)
    for r in results:
        assert "model.attention_dropout: 0.1 is not supported with context parallelism" in r
