"""meshtron's GPTDataset in Megatron's order (`data.sample_order: megatron`, the default) against
megatron-core's GPTDataset built by BlendedMegatronDatasetBuilder on the same Megatron-written files:
the same document, sample and shuffle indices and the same tokens, labels and loss mask for every
sample, over seeds, split strings, sequence lengths, several epochs (the final one shuffled apart or
not) and both settings of add_extra_token_to_sequence; and a short `meshtron train` run on such files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from data_helpers import random_docs
from megatron_harness import megatron_gpt_datasets, write_with_megatron

from meshtron.data.build import build_datasets
from meshtron.data.gpt_dataset import GPTDataset
from meshtron.data.indexed import IndexedDataset
from meshtron.data.megatron_order import num_epochs, num_samples_of, separate_final_epoch
from meshtron.data.tokenizer import ByteTokenizer

BYTE = ByteTokenizer()
NUM_DOCS = 120


@pytest.fixture(scope="module")
def megatron_prefix(tmp_path_factory):
    """Documents of 0..60 byte ids (empty ones included), written by megatron-core, no sidecar."""
    docs = random_docs(np.random.default_rng(19), NUM_DOCS, 60, vocab_size=256)
    prefix = tmp_path_factory.mktemp("megatron") / "corpus"
    write_with_megatron(prefix, docs, np.uint16)
    return str(prefix)


def _epoch_samples(prefix: str, split: str, seq_length: int, fraction: float | str, extra: bool) -> int:
    """A train size of `fraction` epochs of the train split (Megatron's arithmetic of samples per epoch);
    "boundary": a second epoch contributing exactly int(0.8 * samples per epoch) samples, where Megatron
    does not shuffle it apart (its threshold is truncated to an integer)."""
    weights = [float(x) for x in split.split(",")]
    end = int(round(weights[0] / sum(weights) * NUM_DOCS))
    tokens = int(np.asarray(IndexedDataset(prefix).sizes[:end], dtype=np.int64).sum())
    per_epoch = num_samples_of(tokens, seq_length, int(extra))
    if fraction == "boundary":
        assert int(0.8 * per_epoch) != 0.8 * per_epoch
        return per_epoch + int(0.8 * per_epoch)
    return int(fraction * per_epoch)


CASES = [  # seed, seq_length, split, train size in epochs (None: one epoch, no size), add_extra_token
    (1234, 32, "969,30,1", None, True),
    (7, 16, "100,0,0", 2.3, True),          # final epoch shuffled apart
    (3, 10, "80,15,5", 2.95, True),         # final epoch shuffled with the others
    (11, 24, "969,30,1", 3.5, False),
    (5, 8, "90,10", 0.5, False),
    (2, 12, "969,30,1", "boundary", True),
]


def _meshtron_config(tiny_config, prefix, seed, seq_length, split, num_train, extra, order="megatron"):
    return tiny_config(**{"data.paths": f"[{prefix}]", "data.seed": seed, "data.seq_length": seq_length,
                          "data.split": split, "train.global_batch_size": 1, "train.micro_batch_size": 1,
                          "train.train_iters": num_train, "data.sample_order": order,
                          "data.add_extra_token_to_sequence": str(extra).lower()})


@pytest.mark.parametrize("seed,seq_length,split,epochs,extra", CASES)
def test_samples_equal_megatron_core(tiny_config, megatron_prefix, tmp_path, seed, seq_length, split, epochs, extra):
    num_train = _epoch_samples(megatron_prefix, split, seq_length, epochs or 1.0, extra)
    multi_epoch = epochs == "boundary" or (epochs is not None and epochs > 1)
    cfg = _meshtron_config(tiny_config, megatron_prefix, seed, seq_length, split, num_train, extra)
    with pytest.warns(UserWarning, match="no .*corpus.meshtron.json sidecar"):
        mine = build_datasets(cfg, BYTE)
    ref = megatron_gpt_datasets(megatron_prefix, seed=seed, seq_length=seq_length, split=split,
                                sizes=[None if epochs is None else num_train, None, None], cache_dir=tmp_path / "mc",
                                eod=BYTE.eod_id, pad=BYTE.pad_id, vocab_size=BYTE.vocab_size, add_extra_token=extra)
    if multi_epoch:
        assert mine[0].num_epochs > 1
    for ours, theirs in zip(mine, ref):
        if theirs is None:             # Megatron builds no dataset for a zero-width split
            assert len(ours) == 0
            continue
        assert isinstance(ours, GPTDataset) and len(ours) == len(theirs)
        if len(theirs) == 0:
            continue
        assert np.array_equal(ours.doc_idx, theirs.document_index)
        assert np.array_equal(ours.sample_idx, theirs.sample_index)
        assert np.array_equal(ours.shuffle_idx, theirs.shuffle_index)
        for i in range(len(theirs)):
            a, b = ours[i], theirs[i]
            assert np.array_equal(a["input_ids"], b["tokens"].numpy()), i
            assert np.array_equal(a["labels"][:-1], b["labels"][:-1].numpy()), i
            assert np.array_equal(a["loss_mask"], b["loss_mask"].numpy()), i
            if extra:
                assert np.array_equal(a["labels"], b["labels"].numpy()), i


def test_both_final_epoch_branches_are_covered(megatron_prefix):
    """The multi-epoch cases above take both of Megatron's branches (a guard on the cases themselves)."""
    seen = set()
    for _, seq_length, split, epochs, extra in CASES:
        if epochs is None or (epochs != "boundary" and epochs <= 1):
            continue
        n = _epoch_samples(megatron_prefix, split, seq_length, epochs, extra)
        w = [float(x) for x in split.split(",")]
        tokens = int(np.asarray(IndexedDataset(megatron_prefix).sizes[:int(round(w[0] / sum(w) * NUM_DOCS))],
                                dtype=np.int64).sum())
        e = num_epochs(tokens, seq_length, n, int(extra))
        seen.add(separate_final_epoch(tokens, seq_length, n, e, int(extra))[0])
    assert seen == {True, False}


def test_meshtron_order_is_kept(tiny_config, megatron_prefix):
    """data.sample_order: meshtron gives meshtron's earlier order (its own reference: test_gpt_dataset.py)."""
    with pytest.warns(UserWarning):
        a = build_datasets(_meshtron_config(tiny_config, megatron_prefix, 1, 16, "100,0,0", 10, True), BYTE)[0]
    with pytest.warns(UserWarning):
        b = build_datasets(_meshtron_config(tiny_config, megatron_prefix, 1, 16, "100,0,0", 10, True, "meshtron"),
                           BYTE)[0]
    assert a.sample_order == "megatron" and b.sample_order == "meshtron"
    assert sorted(a.doc_idx.tolist()) == sorted(b.doc_idx.tolist()) and a.doc_idx.tolist() != b.doc_idx.tolist()


def test_meshtron_train_on_a_megatron_dataset(tmp_path, megatron_prefix):
    """`meshtron train` reads files megatron-core wrote (tiny model, a few steps)."""
    from meshtron.cli import main

    overrides = {"model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
                 "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
                 "data.seq_length": "32", "train.micro_batch_size": "2", "train.global_batch_size": "4",
                 "train.train_iters": "3", "train.eval_interval": "0", "logger.progress_bar": "off",
                 "train.run_dir": str(tmp_path / "run"), "data.paths": f"[{megatron_prefix}]",
                 "checkpoint.save_at_end": "false", "train.peak_flops": "1e11", "logger.log_interval": "1"}
    argv = ["train"] + [x for k, v in overrides.items() for x in (f"--{k}", v)]
    with pytest.warns(UserWarning, match="Megatron's format, no .*sidecar"):
        assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(384), rel=0.1)   # untrained over the padded byte vocabulary
