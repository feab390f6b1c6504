"""GPTDataset indices: identical across builds, cached, and equal to a slow pure-Python reference
that walks the document stream token by token; samples equal slices of that stream."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import random_docs, write_indexed

from meshtron.data.gpt_dataset import GPTDataset, split_document_ranges


def reference_doc_idx(doc_range, num_epochs, seed, separate_last):
    """The documents of every epoch, shuffled by the same seeded generator calls."""
    rng = np.random.default_rng(seed)
    docs = list(range(*doc_range))
    if separate_last and num_epochs > 1:
        first = np.array(docs * (num_epochs - 1))
        rng.shuffle(first)
        last = np.array(docs)
        rng.shuffle(last)
        return first.tolist() + last.tolist(), rng
    out = np.array(docs * num_epochs)
    rng.shuffle(out)
    return out.tolist(), rng


def reference_sample_idx(sizes, doc_idx, seq_length):
    """Walk every token; record (document position, offset) of each token at a multiple of seq_length."""
    rows, g = [], 0
    total = sum(int(sizes[d]) for d in doc_idx)
    num_samples = (total - 1) // seq_length
    for p, d in enumerate(doc_idx):
        for t in range(int(sizes[d])):
            if g % seq_length == 0 and g // seq_length <= num_samples:
                rows.append((p, t))
            g += 1
    return rows


def reference_shuffle_idx(num_samples, num_first, rng, separate_last):
    """Sample order: one shuffle of every sample, or (separate last epoch) the samples of the full epochs
    shuffled first and those of the last one shuffled after them, by the generator the documents used."""
    if not separate_last:
        order = np.array(list(range(num_samples)))
        rng.shuffle(order)
        return order.tolist()
    first, last = np.array(list(range(num_first))), np.array(list(range(num_first, num_samples)))
    rng.shuffle(first)
    rng.shuffle(last)
    return first.tolist() + last.tolist()


def stream_of(ds, doc_idx):
    return [tok for d in doc_idx for tok in ds[d].tolist()]


@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_one_epoch_matches_reference(tmp_path, seq_length):
    rng = np.random.default_rng(seq_length)
    indexed = write_indexed(tmp_path / "d", random_docs(rng, 30, 25))   # with empty documents
    ds = GPTDataset(indexed, (3, 27), seq_length=seq_length, seed=5, eod_id=999, cache_dir=str(tmp_path / "c"),
                    sample_order="meshtron")
    ref_doc_idx, ref_rng = reference_doc_idx((3, 27), 1, 5, False)
    assert ds.doc_idx.tolist() == ref_doc_idx
    assert [tuple(r) for r in ds.sample_idx.tolist()] == reference_sample_idx(indexed.sizes, ref_doc_idx, seq_length)
    stream = stream_of(indexed, ref_doc_idx)
    assert len(ds) == (len(stream) - 1) // seq_length
    assert ds.shuffle_idx.tolist() == reference_shuffle_idx(len(ds), len(ds), ref_rng, False)
    for i in range(len(ds)):
        j = int(ds.shuffle_idx[i])
        window = stream[j * seq_length:(j + 1) * seq_length + 1]
        assert ds.window(i).tolist() == window
        sample = ds[i]
        assert sample["input_ids"].tolist() == window[:-1] and sample["labels"].tolist() == window[1:]


def test_identical_across_builds_and_cached(tmp_path):
    rng = np.random.default_rng(0)
    indexed = write_indexed(tmp_path / "d", random_docs(rng, 40, 50))
    kwargs = dict(seq_length=16, seed=3, eod_id=999, num_samples=200)
    a = GPTDataset(indexed, (0, 40), cache_dir=str(tmp_path / "c1"), **kwargs)
    b = GPTDataset(indexed, (0, 40), cache_dir=str(tmp_path / "c2"), **kwargs)
    c = GPTDataset(indexed, (0, 40), cache_dir=str(tmp_path / "c1"), **kwargs)
    assert not a.cache.loaded_from_cache and not b.cache.loaded_from_cache and c.cache.loaded_from_cache
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
        assert np.array_equal(getattr(a, name), getattr(c, name))
    d = GPTDataset(indexed, (0, 40), cache_dir=str(tmp_path / "c1"), **{**kwargs, "seed": 4})
    assert not d.cache.loaded_from_cache and not np.array_equal(a.shuffle_idx, d.shuffle_idx)


def test_default_cache_lives_next_to_the_data(tmp_path):
    indexed = write_indexed(tmp_path / "data" / "d", [[1, 2, 3, 4, 5]] * 4)
    GPTDataset(indexed, (0, 4), seq_length=4, seed=0, eod_id=999)
    assert sorted(p.name.split("-")[-1] for p in (tmp_path / "data" / "cache").iterdir()) == [
        "description.json", "doc_idx.npy", "sample_idx.npy", "shuffle_idx.npy"]


@pytest.mark.parametrize("last_epoch_fraction,separate", [(0.3, True), (0.95, False)])
def test_epochs_and_separate_last_epoch(tmp_path, last_epoch_fraction, separate):
    rng = np.random.default_rng(1)
    indexed = write_indexed(tmp_path / "d", random_docs(rng, 12, 40, min_len=1))
    seq_length = 10
    tokens = int(indexed.sizes.sum())
    # Two full epochs and a fraction of a third.
    num_samples = (2 * tokens - 1) // seq_length + int(last_epoch_fraction * ((tokens - 1) // seq_length))
    ds = GPTDataset(indexed, (0, 12), seq_length=seq_length, seed=9, eod_id=999, num_samples=num_samples,
                    cache_dir=str(tmp_path / "c"), sample_order="meshtron")
    num_epochs = ds.num_epochs
    assert (num_epochs * tokens - 1) // seq_length >= num_samples > ((num_epochs - 1) * tokens - 1) // seq_length
    num_first = ((num_epochs - 1) * tokens - 1) // seq_length
    per_epoch = (tokens - 1) // seq_length
    assert ((num_samples - num_first) < 0.8 * per_epoch) == separate
    ref_doc_idx, ref_rng = reference_doc_idx((0, 12), num_epochs, 9, separate)
    assert ds.doc_idx.tolist() == ref_doc_idx
    assert np.bincount(ds.doc_idx, minlength=12).tolist() == [num_epochs] * 12
    assert [tuple(r) for r in ds.sample_idx.tolist()] == reference_sample_idx(indexed.sizes, ref_doc_idx, seq_length)
    total = (num_epochs * tokens - 1) // seq_length
    assert ds.shuffle_idx.tolist() == reference_shuffle_idx(total, num_first, ref_rng, separate)
    if separate:  # samples of the full epochs come first, in their own permutation
        assert sorted(ds.shuffle_idx[:num_first].tolist()) == list(range(num_first))
    stream = stream_of(indexed, ref_doc_idx)
    for i in range(0, len(ds), 7):
        j = int(ds.shuffle_idx[i])
        assert ds.window(i).tolist() == stream[j * seq_length:(j + 1) * seq_length + 1]


def test_split_by_document():
    assert split_document_ranges(1000, [0.969, 0.03, 0.001]) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(10, [1.0, 0.0, 0.0]) == [(0, 10), (10, 10), (10, 10)]
    assert split_document_ranges(3, [0.5, 0.5, 0.0]) == [(0, 2), (2, 3), (3, 3)]


def test_empty_split_and_packed_masks(tmp_path):
    indexed = write_indexed(tmp_path / "d", [[1, 2, 999], [3, 4, 5, 999], [6, 999]])
    empty = GPTDataset(indexed, (1, 1), seq_length=4, seed=0, eod_id=999, cache_dir=str(tmp_path / "c"))
    assert len(empty) == 0
    ds = GPTDataset(indexed, (0, 3), seq_length=8, seed=0, eod_id=999, cache_dir=str(tmp_path / "c"),
                    reset_attention_mask=True, reset_position_ids=True)
    assert len(ds) == 1
    s = ds[0]
    # document ids change after every eod of the input
    eod_at = [k for k, t in enumerate(s["input_ids"].tolist()) if t == 999]
    for k in range(1, 8):
        assert (s["document_ids"][k] != s["document_ids"][k - 1]) == (k - 1 in eod_at)
        assert s["position_ids"][k] == (0 if k - 1 in eod_at else s["position_ids"][k - 1] + 1)
