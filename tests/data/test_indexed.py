"""The .bin/.idx format: documents read back exactly, the dtype follows the vocabulary size, and
truncated, corrupt or mismatched pairs are refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import random_docs, write_indexed

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
