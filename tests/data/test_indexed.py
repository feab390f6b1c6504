"""The .bin/.idx format: documents read back exactly, the dtype follows the vocabulary size, and
truncated, corrupt or mismatched pairs are refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import random_docs, rewrite_idx, set_token, write_indexed

from meshtron.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, merge_datasets


def test_round_trip_documents_and_slices(tmp_path):
    rng = np.random.default_rng(0)
    docs = random_docs(rng, 50, 40)   # includes empty documents
    ds = write_indexed(tmp_path / "a", docs, vocab_size=1000)
    assert len(ds) == 50 and ds.num_tokens == sum(map(len, docs)) and ds.dtype == np.uint16
    for k, d in enumerate(docs):
        assert ds[k].tolist() == d
        assert ds.sizes[k] == len(d)
        if len(d) > 3:
            assert ds.get(k, 1, 2).tolist() == d[1:3]
            assert ds.get(k, 2).tolist() == d[2:]
    assert ds[-1].tolist() == docs[-1]
    with pytest.raises(IndexError):
        ds[50]
    ds.verify()


def test_dtype_from_vocab_size(tmp_path):
    small = write_indexed(tmp_path / "small", [[0, 65535]], vocab_size=65536)
    large = write_indexed(tmp_path / "large", [[0, 65536, 150000]], vocab_size=151_936)
    assert small.dtype == np.uint16 and small[0].tolist() == [0, 65535]
    assert large.dtype == np.int32 and large[0].tolist() == [0, 65536, 150000]
    with pytest.raises(IndexedDatasetError, match="outside"):
        write_indexed(tmp_path / "bad", [[5, 70000]], vocab_size=65536)


def test_empty_dataset(tmp_path):
    ds = write_indexed(tmp_path / "empty", [], vocab_size=10)
    assert len(ds) == 0 and ds.num_tokens == 0


def test_truncated_bin_and_idx_are_detected(tmp_path):
    write_indexed(tmp_path / "a", [[1, 2, 3], [4, 5]])
    data = (tmp_path / "a.bin").read_bytes()
    (tmp_path / "a.bin").write_bytes(data[:-2])
    with pytest.raises(IndexedDatasetError, match="truncated"):
        IndexedDataset(tmp_path / "a")
    write_indexed(tmp_path / "b", [[1, 2, 3], [4, 5]])
    idx = (tmp_path / "b.idx").read_bytes()
    (tmp_path / "b.idx").write_bytes(idx[:-4])
    with pytest.raises(IndexedDatasetError, match="truncated"):
        IndexedDataset(tmp_path / "b")
    (tmp_path / "b.idx").write_bytes(idx[:10])
    with pytest.raises(IndexedDatasetError, match="truncated header"):
        IndexedDataset(tmp_path / "b")


def test_mismatched_pair_is_detected(tmp_path):
    # Same sizes, different writes: only the pair id tells them apart.
    write_indexed(tmp_path / "a", [[1, 2, 3]])
    write_indexed(tmp_path / "b", [[7, 8, 9]])
    (tmp_path / "a.bin").write_bytes((tmp_path / "b.bin").read_bytes())
    with pytest.raises(IndexedDatasetError, match="does not belong"):
        IndexedDataset(tmp_path / "a")


def test_corruption_is_caught_by_checksum(tmp_path):
    ds = write_indexed(tmp_path / "a", [[1, 2, 3, 4]])
    data = bytearray((tmp_path / "a.bin").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "a.bin").write_bytes(bytes(data))
    with pytest.raises(IndexedDatasetError, match="checksum"):
        IndexedDataset(ds.prefix).verify()


def test_missing_files_and_unfinished_writer(tmp_path):
    with pytest.raises(IndexedDatasetError, match="not found"):
        IndexedDataset(tmp_path / "nothing")
    writer = IndexedDatasetWriter(tmp_path / "w", 10)
    writer.add_document([1, 2])
    with pytest.raises(IndexedDatasetError, match="not found"):
        IndexedDataset(tmp_path / "w")   # nothing appears under the final names before finalize
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_merge_keeps_order_and_checks_vocab(tmp_path):
    rng = np.random.default_rng(1)
    parts = [random_docs(rng, n, 20) for n in (3, 0, 5)]
    prefixes = [str(write_indexed(tmp_path / f"p{k}", docs).prefix) for k, docs in enumerate(parts)]
    merged = merge_datasets(prefixes, tmp_path / "all")
    assert [merged[k].tolist() for k in range(len(merged))] == [d for docs in parts for d in docs]
    merged.verify()
    write_indexed(tmp_path / "other", [[1]], vocab_size=70000)
    with pytest.raises(IndexedDatasetError, match="vocab_size"):
        merge_datasets([prefixes[0], str(tmp_path / "other")], tmp_path / "bad")


def first_disagreement(offsets, sizes):
    """Naive reference: the first document whose offsets do not span its size."""
    for k in range(len(sizes)):
        if offsets[k + 1] - offsets[k] != sizes[k] or sizes[k] < 0:
            return k
    return None


@pytest.mark.parametrize("chunk", [None, 7])   # 7: the vectorised check crosses chunk boundaries
def test_sizes_that_disagree_with_offsets_are_refused_on_open(tmp_path, monkeypatch, chunk):
    """Issue 16: a .idx whose sizes disagree with its offsets (same total, so every file size and the
    last offset still agree) used to open and feed wrong windows to training; now opening names it."""
    if chunk:
        monkeypatch.setattr("meshtron.data.indexed.CHECK_ENTRIES", chunk)
    rng = np.random.default_rng(3)
    docs = random_docs(rng, 30, 20, min_len=2)
    ds = write_indexed(tmp_path / "a", docs)
    offsets, sizes = np.array(ds.offsets), np.array(ds.sizes)
    for k in (0, 6, 7, 29):
        bad = sizes.copy()
        bad[k] += 1
        bad[(k + 1) % 30] -= 1     # the total is unchanged
        rewrite_idx(tmp_path / "a", sizes=bad)
        expected = first_disagreement(offsets, bad)
        with pytest.raises(IndexedDatasetError, match=rf"a\.idx: document {expected} has size {bad[expected]} "):
            IndexedDataset(tmp_path / "a")
    rewrite_idx(tmp_path / "a", sizes=sizes)
    IndexedDataset(tmp_path / "a")
    shifted = offsets.copy()
    shifted[10] += 3               # an offset moved inside the file: two documents disagree
    rewrite_idx(tmp_path / "a", offsets=shifted)
    with pytest.raises(IndexedDatasetError, match=f"document {first_disagreement(shifted, sizes)} has size"):
        IndexedDataset(tmp_path / "a")
    shifted = offsets.copy()
    shifted[0] = 1
    rewrite_idx(tmp_path / "a", offsets=shifted)
    with pytest.raises(IndexedDatasetError, match="offsets run from 1"):
        IndexedDataset(tmp_path / "a")


def test_maximum_token_id_is_recorded_and_merged(tmp_path):
    rng = np.random.default_rng(4)
    parts = [random_docs(rng, n, 30, vocab_size=500) for n in (4, 6)]
    a = write_indexed(tmp_path / "a", parts[0])
    b = write_indexed(tmp_path / "b", parts[1])
    assert a.max_token_id == max(max(d, default=-1) for d in parts[0])
    assert b.max_token_id == max(max(d, default=-1) for d in parts[1])
    assert write_indexed(tmp_path / "empty", []).max_token_id is None
    # A dataset written before the maximum was recorded (the field was 0) still opens and reads...
    rewrite_idx(tmp_path / "b", max_id_field=0)
    old = IndexedDataset(tmp_path / "b")
    assert old.max_token_id is None and [old[k].tolist() for k in range(len(old))] == parts[1]
    # ...and merging it records the maximum, taken from its tokens.
    merged = merge_datasets([a.prefix, old.prefix], tmp_path / "m")
    assert merged.max_token_id == max(a.max_token_id, b.max_token_id)
    assert merged.verify() == merged.max_token_id
    rewrite_idx(tmp_path / "a", max_id_field=1001)
    with pytest.raises(IndexedDatasetError, match="maximum token id 1000 outside its own vocab_size 1000"):
        IndexedDataset(tmp_path / "a")


def test_out_of_vocabulary_ids_are_refused_on_read_and_by_verify(tmp_path):
    """Issue 16: an id past the vocabulary in a same-size corrupted .bin used to be handed out (and
    reached the embedding); every read now refuses it, naming the document, and verify finds it."""
    docs = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    ds = write_indexed(tmp_path / "a", docs, vocab_size=1000)
    assert ds.verify() == 9 and ds.verify(vocab_size=10) == 9
    with pytest.raises(IndexedDatasetError, match=r"2 token ids >= vocab size 8 \(maximum id 9, first in document 2\)"):
        ds.verify(vocab_size=8)
    set_token(tmp_path / "a", 4, 60000)   # document 1, position 1
    ds = IndexedDataset(tmp_path / "a")
    assert ds[0].tolist() == [1, 2, 3]
    for read in (lambda: ds[1], lambda: ds.get(1, 1, 2)):
        with pytest.raises(IndexedDatasetError, match=r"a\.bin: document 1 holds token id 60000, outside the vocabulary of 1000"):
            read()
    assert ds.get(1, 2).tolist() == [6, 7]     # the slice without the bad token is fine
    with pytest.raises(IndexedDatasetError, match="checksum"):
        ds.verify()
    ds.id_limit = 3                           # a smaller model vocabulary, as training sets it
    assert ds.get(0, 0, 2).tolist() == [1, 2]
    with pytest.raises(IndexedDatasetError, match="document 0 holds token id 3, outside the vocabulary of 3"):
        ds[0]
