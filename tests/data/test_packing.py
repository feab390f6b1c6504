"""Packing: best fit equals a slow reference, packed samples hold every token of every document
exactly once, and attention never crosses documents (checked against separate per-document forwards)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from data_helpers import random_docs, write_indexed

from meshtron.config.schema import ModelConfig
from meshtron.data.gpt_dataset import GPTDataset
from meshtron.data.packing import BestFitPacker, PackedDataset, best_fit_decreasing, document_pieces
from meshtron.models import GPTModel
from meshtron.nn.context import PackedContext

EOD, PAD = 98, 99


def reference_best_fit(lengths, capacity):
    bins, free = [], []
    for item, n in lengths:
        fits = [(free[b], b) for b in range(len(bins)) if free[b] >= n]
        if fits:
            _, b = min(fits)
        else:
            b = len(bins)
            bins.append([])
            free.append(capacity)
        bins[b].append(item)
        free[b] -= n
    return bins


def test_best_fit_matches_reference():
    rng = np.random.default_rng(0)
    for capacity in (1, 5, 64):
        lengths = rng.integers(1, capacity + 1, size=300)
        packer = BestFitPacker(capacity)
        for i, n in enumerate(lengths):
            packer.add(i, int(n))
        assert packer.bins == reference_best_fit(list(enumerate(lengths.tolist())), capacity)
        order = np.argsort(-lengths, kind="stable")
        bfd = best_fit_decreasing(lengths, capacity)
        assert bfd == reference_best_fit([(int(i), int(lengths[i])) for i in order], capacity)
        assert sorted(i for b in bfd for i in b) == list(range(300))
        assert all(sum(lengths[i] for i in b) <= capacity for b in bfd)
    with pytest.raises(ValueError, match="length"):
        BestFitPacker(4).add(0, 5)


def test_document_pieces_cover_each_label_once():
    sizes = np.array([0, 1, 2, 5, 9, 10, 11, 23])
    pieces = document_pieces(sizes, (0, 8), 4)
    for d, n in enumerate(sizes):
        rows = pieces[pieces[:, 0] == d]
        covered = [o + k for o, length in rows[:, 1:] for k in range(1, length)]   # label positions
        assert covered == list(range(1, n))
        assert np.all(rows[:, 2] <= 5)


def unpack(sample):
    """Pieces of a packed sample: for each document id, its inputs then the last label."""
    out = []
    ids = sample["document_ids"]
    for k in np.unique(ids[sample["loss_mask"] > 0]):
        at = ids == k
        out.append(sample["input_ids"][at].tolist() + [int(sample["labels"][at][-1])])
    return out


def test_packed_dataset_holds_every_token_once(tmp_path):
    rng = np.random.default_rng(1)
    docs = [d + [EOD] for d in random_docs(rng, 40, 30, vocab_size=90)]
    indexed = write_indexed(tmp_path / "d", docs, vocab_size=100)
    ds = PackedDataset(indexed, (0, 40), seq_length=12, pad_id=PAD, cache_dir=str(tmp_path / "c"))
    got = sorted(tuple(p) for i in range(len(ds)) for p in unpack(ds[i]))
    want = sorted(tuple(d[o:o + n]) for d, (_, o, n) in zip((docs[r[0]] for r in ds.pieces), ds.pieces))
    assert got == want
    total_labels = sum(len(d) - 1 for d in docs)
    assert sum(int(ds[i]["loss_mask"].sum()) for i in range(len(ds))) == total_labels
    for i in range(len(ds)):
        s = ds[i]
        pad = s["loss_mask"] == 0
        assert np.all(s["input_ids"][pad] == PAD) and np.all(s["labels"][pad] == PAD)
        for k in np.unique(s["document_ids"]):
            assert s["position_ids"][s["document_ids"] == k].tolist() == list(range(int((s["document_ids"] == k).sum())))
    # best fit leaves little room: at most one sample per distinct free space is left half empty
    assert len(ds) <= -(-total_labels // 12) + 2


def tiny_model():
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                      max_position_embeddings=64)
    return GPTModel(cfg, 100).eval()


def assert_matches_separate_forwards(model, sample):
    tokens = torch.from_numpy(sample["input_ids"])[None]
    doc_ids = torch.from_numpy(sample["document_ids"])[None]
    positions = torch.from_numpy(sample["position_ids"])[None]
    with torch.no_grad():
        packed = model(tokens, PackedContext.for_tokens(tokens, document_ids=doc_ids, positions=positions))[0]
        for k in torch.unique(doc_ids):
            at = doc_ids[0] == k
            alone = model(tokens[:, at])[0]   # the document by itself, positions from 0
            torch.testing.assert_close(packed[at], alone, rtol=1e-5, atol=1e-5)
        # Without the document mask the logits differ: the check above has teeth.
        plain = model(tokens)[0]
    assert not torch.allclose(plain, packed, atol=1e-4)


def test_best_fit_attention_never_crosses_documents(tmp_path):
    rng = np.random.default_rng(2)
    docs = [d + [EOD] for d in random_docs(rng, 12, 20, vocab_size=90, min_len=2)]
    indexed = write_indexed(tmp_path / "d", docs, vocab_size=100)
    ds = PackedDataset(indexed, (0, 12), seq_length=32, pad_id=PAD, cache_dir=str(tmp_path / "c"))
    model = tiny_model()
    multi = [i for i in range(len(ds)) if len(np.unique(ds[i]["document_ids"])) >= 3]
    assert multi
    for i in multi[:2]:
        assert_matches_separate_forwards(model, ds[i])


def test_concat_samples_with_reset_masks_keep_documents_apart(tmp_path):
    rng = np.random.default_rng(3)
    docs = [d + [EOD] for d in random_docs(rng, 20, 10, vocab_size=90, min_len=2)]
    indexed = write_indexed(tmp_path / "d", docs, vocab_size=100)
    ds = GPTDataset(indexed, (0, 20), seq_length=32, seed=0, eod_id=EOD, pad_id=PAD, cache_dir=str(tmp_path / "c"),
                    reset_attention_mask=True, reset_position_ids=True)
    assert_matches_separate_forwards(tiny_model(), ds[0])
