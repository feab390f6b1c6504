"""Megatron-LM's MMIDIDX .bin/.idx, against megatron-core itself: files its IndexedDatasetBuilder writes
are read by meshtron (every dtype code, grouped documents), files meshtron writes are byte-identical to
the builder's and read by its IndexedDataset; truncation and corruption are refused in one line;
`meshtron data convert` round-trips byte for byte in bounded memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from data_helpers import random_docs, write_indexed
from megatron_harness import read_with_megatron, write_with_megatron

from meshtron.data import commands
from meshtron.data.convert import convert_dataset
from meshtron.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, merge_datasets
from meshtron.data.tokenizer import build_tokenizer, tokenizer_config_for

MEGATRON_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16]


def docs_of(ds: IndexedDataset) -> list[list[int]]:
    return [np.asarray(ds[k]).astype(np.int64).tolist() for k in range(len(ds))]


def same_bytes(a, b) -> bool:
    return Path(a).read_bytes() == Path(b).read_bytes()


@pytest.mark.parametrize("dtype", MEGATRON_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_megatron_dtype_is_read(tmp_path, dtype):
    rng = np.random.default_rng(3)
    docs = random_docs(rng, 25, 30, vocab_size=120)          # with empty documents; ids fit every dtype
    write_with_megatron(tmp_path / "m", docs, dtype)
    ds = IndexedDataset(tmp_path / "m")
    assert (ds.format, ds.dtype, ds.num_docs, ds.grouped) == ("megatron", np.dtype(dtype), 25, False)
    assert docs_of(ds) == docs
    assert ds.num_tokens == sum(map(len, docs)) and ds.sizes.tolist() == list(map(len, docs))
    assert ds.vocab_size is None and ds.max_token_id is None and not ds.has_sidecar
    assert ds.verify() == max(max(d) for d in docs if d)
    assert ds.get(1, 1, 2).tolist() == docs[1][1:3] or len(docs[1]) < 3


def test_grouped_documents_are_sequences(tmp_path):
    """`--split-sentences` groups several sequences into one document; like Megatron's GPTDataset,
    meshtron samples sequences and keeps the grouping only to write it back."""
    docs = random_docs(np.random.default_rng(4), 30, 20, min_len=1)
    write_with_megatron(tmp_path / "g", docs, np.uint16, sentences_per_doc=4)
    ds = IndexedDataset(tmp_path / "g")
    assert ds.grouped and ds.num_docs == 30 and docs_of(ds) == docs
    ref = np.frombuffer(Path(tmp_path / "g.idx").read_bytes()[34 + 12 * 30:], dtype=np.int64)
    assert ds.document_indices.tolist() == ref.tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 30]
    # Merging keeps the grouping, byte for byte what megatron-core's builder writes for the same documents.
    merge_datasets([str(tmp_path / "g"), str(tmp_path / "g")], tmp_path / "gg")
    write_with_megatron(tmp_path / "ref", docs + docs, np.uint16, sentences_per_doc=4)   # 30 % 4: groups differ
    out = IndexedDataset(tmp_path / "gg")
    assert out.document_indices.tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 30, 34, 38, 42, 46, 50, 54, 58, 60]
    assert same_bytes(tmp_path / "gg.bin", tmp_path / "ref.bin")


def test_preprocess_writes_what_megatron_writes(tmp_path, jsonl_file, documents):
    """`meshtron preprocess --format megatron` (several shards, merged) == megatron-core's builder fed the
    same token ids: identical .bin and .idx bytes; megatron-core's reader reads it; the sidecar holds
    meshtron's integrity data."""
    out = tmp_path / "pre"
    assert commands.main(["preprocess", "--input", str(jsonl_file), "--output-prefix", str(out), "--tokenizer",
                          "byte", "--append-eod", "--workers", "1", "--shard-size-mb", "0.02",
                          "--no-progress", "--format", "megatron"]) == 0
    tok = build_tokenizer(tokenizer_config_for("byte"))
    ids = [tok.encode(d) + [tok.eod_id] for d in documents]
    write_with_megatron(tmp_path / "ref", ids, np.uint16)
    assert same_bytes(f"{out}.bin", tmp_path / "ref.bin") and same_bytes(f"{out}.idx", tmp_path / "ref.idx")
    assert [d.tolist() for d in read_with_megatron(out)] == ids
    side = json.loads(Path(f"{out}.meshtron.json").read_text())
    ds = IndexedDataset(out)
    assert (side["vocab_size"], side["max_token_id"], side["num_tokens"]) == (tok.vocab_size, max(map(max, ids)),
                                                                              sum(map(len, ids)))
    assert (ds.vocab_size, ds.max_token_id, ds.has_sidecar) == (tok.vocab_size, max(map(max, ids)), True)
    assert ds.verify() == max(map(max, ids))


def test_megatron_is_the_default_format(tmp_path, jsonl_file):
    out = tmp_path / "d"
    assert commands.main(["preprocess", "--input", str(jsonl_file), "--output-prefix", str(out), "--tokenizer",
                          "byte", "--workers", "1", "--no-progress"]) == 0
    assert IndexedDataset(out).format == "megatron" and Path(f"{out}.meshtron.json").is_file()


def test_int32_tokens_byte_identical(tmp_path):
    """A vocabulary above 65536 ids writes int32 tokens, as Megatron does for it."""
    docs = random_docs(np.random.default_rng(5), 40, 50, vocab_size=100_000)
    writer = IndexedDatasetWriter(tmp_path / "w", 100_000, "megatron")
    for d in docs:
        writer.add_document(d)
    writer.finalize()
    write_with_megatron(tmp_path / "ref", docs, np.int32)
    assert same_bytes(tmp_path / "w.bin", tmp_path / "ref.bin") and same_bytes(tmp_path / "w.idx", tmp_path / "ref.idx")
    assert [d.tolist() for d in read_with_megatron(tmp_path / "w")] == docs


def _megatron_pair(tmp_path, name="m", dtype=np.uint16):
    docs = random_docs(np.random.default_rng(6), 20, 30, vocab_size=500, min_len=1)
    write_with_megatron(tmp_path / name, docs, dtype)
    return tmp_path / name, docs


def _cut(path, num_bytes: int) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:len(data) - num_bytes])


def test_truncated_and_corrupt_megatron_files_are_refused(tmp_path):
    prefix, docs = _megatron_pair(tmp_path)
    _cut(f"{prefix}.bin", 2)
    with pytest.raises(IndexedDatasetError, match=r"m\.bin: \d+ bytes, expected \d+ for \d+ tokens \(truncated"):
        IndexedDataset(prefix)
    prefix, _ = _megatron_pair(tmp_path)
    _cut(f"{prefix}.idx", 8)
    with pytest.raises(IndexedDatasetError, match=r"m\.idx: \d+ bytes, expected \d+ for 20 sequences and 21 "):
        IndexedDataset(prefix)
    Path(f"{prefix}.idx").write_bytes(Path(f"{prefix}.idx").read_bytes()[:20])
    with pytest.raises(IndexedDatasetError, match="truncated Megatron index header"):
        IndexedDataset(prefix)
    # A sequence length that disagrees with the pointers (same file size).
    prefix, _ = _megatron_pair(tmp_path)
    raw = bytearray(Path(f"{prefix}.idx").read_bytes())
    raw[34 + 4 * 3:34 + 4 * 4] = np.int32(999).tobytes()
    Path(f"{prefix}.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="lengths and pointers disagree"):
        IndexedDataset(prefix)
    prefix, _ = _megatron_pair(tmp_path)
    raw = bytearray(Path(f"{prefix}.idx").read_bytes())
    raw[-8:] = np.int64(7).tobytes()              # the last document index must be the sequence count
    Path(f"{prefix}.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="document indices run from 0 to 7, not from 0 to 20"):
        IndexedDataset(prefix)
    raw[9:17] = np.uint64(2).tobytes()
    Path(f"{prefix}.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="Megatron index version 2; meshtron reads version 1"):
        IndexedDataset(prefix)
    Path(f"{prefix}.idx").write_bytes(b"GARBAGE!!" + bytes(raw[9:]))
    with pytest.raises(IndexedDatasetError, match="neither meshtron's .* nor Megatron's .* index magic"):
        IndexedDataset(prefix)


def test_meshtron_index_version_message(tmp_path):
    """Issue 19: a meshtron index of another version said "not a meshtron index (version 1)"."""
    ds = write_indexed(tmp_path / "a", [[1, 2], [3]])
    raw = bytearray(Path(f"{ds.prefix}.idx").read_bytes())
    raw[8:12] = np.uint32(2).tobytes()
    Path(f"{ds.prefix}.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="meshtron index version 2; this meshtron reads version 1"):
        IndexedDataset(ds.prefix)


def test_sidecar_ties_the_pair(tmp_path):
    """The sidecar records the .idx checksum: an .idx rewritten later is caught; a flipped token is
    caught by verify (checksum), and a token past the vocabulary by every read."""
    docs = random_docs(np.random.default_rng(7), 20, 30, vocab_size=300, min_len=1)
    ds = write_indexed(tmp_path / "s", docs, vocab_size=300, format="megatron")
    write_with_megatron(tmp_path / "s", docs[:-1], np.uint16)              # Megatron rewrites the pair
    with pytest.raises(IndexedDatasetError, match=r"s\.meshtron\.json: does not belong to .*s\.idx"):
        IndexedDataset(ds.prefix)
    ds = write_indexed(tmp_path / "s", docs, vocab_size=300, format="megatron")
    raw = bytearray(Path(f"{ds.prefix}.bin").read_bytes())
    raw[0:2] = np.uint16(docs[0][0] ^ 1).tobytes()
    Path(f"{ds.prefix}.bin").write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="checksum .* differs from the recorded"):
        IndexedDataset(ds.prefix).verify()
    raw[0:2] = np.uint16(400).tobytes()
    Path(f"{ds.prefix}.bin").write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="document 0 holds token id 400, outside the vocabulary of 300"):
        IndexedDataset(ds.prefix)[0]
    Path(f"{ds.prefix}.meshtron.json").write_text("{not json")
    with pytest.raises(IndexedDatasetError, match="not a meshtron sidecar"):
        IndexedDataset(ds.prefix)


def test_negative_ids_of_signed_dtypes_are_refused(tmp_path):
    write_with_megatron(tmp_path / "n", [[1, 2, -3]], np.int16)
    with pytest.raises(IndexedDatasetError, match="holds token id -3"):
        IndexedDataset(tmp_path / "n")[0]
    with pytest.raises(IndexedDatasetError, match="1 token ids < 0"):
        IndexedDataset(tmp_path / "n").verify()


def test_convert_round_trips_byte_for_byte(tmp_path):
    docs = random_docs(np.random.default_rng(8), 50, 40, vocab_size=700)
    mesh = write_indexed(tmp_path / "a", docs, vocab_size=700)                 # meshtron's format
    convert_dataset(mesh.prefix, str(tmp_path / "b"), "megatron")
    write_with_megatron(tmp_path / "ref", docs, np.uint16)
    assert same_bytes(tmp_path / "b.bin", tmp_path / "ref.bin") and same_bytes(tmp_path / "b.idx", tmp_path / "ref.idx")
    assert [d.tolist() for d in read_with_megatron(tmp_path / "b")] == docs
    back = convert_dataset(str(tmp_path / "b"), str(tmp_path / "c"), "meshtron")
    assert back.format == "meshtron" and back.pair_id == mesh.pair_id       # the sidecar carried the pair id
    assert same_bytes(tmp_path / "a.bin", tmp_path / "c.bin") and same_bytes(tmp_path / "a.idx", tmp_path / "c.idx")
    # A Megatron file without sidecar: meshtron's format needs the vocabulary size, then round-trips too.
    with pytest.raises(IndexedDatasetError, match="--vocab-size: .*ref records no vocabulary size"):
        convert_dataset(str(tmp_path / "ref"), str(tmp_path / "d"), "meshtron")
    assert not Path(tmp_path / "d.idx").exists() and not Path(tmp_path / "d.bin.partial").exists()
    assert commands.main(["data", "convert", "--input", str(tmp_path / "ref"), "--output", str(tmp_path / "d"),
                          "--format", "meshtron", "--vocab-size", "700"]) == 0
    assert docs_of(IndexedDataset(tmp_path / "d")) == docs and IndexedDataset(tmp_path / "d").vocab_size == 700
    convert_dataset(str(tmp_path / "d"), str(tmp_path / "e"), "megatron")
    assert same_bytes(tmp_path / "e.bin", tmp_path / "ref.bin") and same_bytes(tmp_path / "e.idx", tmp_path / "ref.idx")


def test_convert_casts_dtypes_meshtron_cannot_hold(tmp_path):
    docs = random_docs(np.random.default_rng(9), 10, 20, vocab_size=200, min_len=1)
    write_with_megatron(tmp_path / "u8", docs, np.uint8)
    out = convert_dataset(str(tmp_path / "u8"), str(tmp_path / "m"), "meshtron", vocab_size=256)
    assert out.dtype == np.uint16 and docs_of(out) == docs
    write_with_megatron(tmp_path / "big", [[5, 70000]], np.int64)
    with pytest.raises(IndexedDatasetError, match="token id 70000 outside \\[0, 1000\\)"):
        convert_dataset(str(tmp_path / "big"), str(tmp_path / "x"), "meshtron", vocab_size=1000)
    assert not any(p.name.startswith("x.") for p in tmp_path.iterdir())        # nothing left behind


def test_convert_streams_in_bounded_memory(tmp_path):
    """Peak Python/numpy allocation during a convert stays near the chunk size, far below the payload."""
    rng = np.random.default_rng(10)
    writer = IndexedDatasetWriter(tmp_path / "big", 100_000, "megatron")       # int32 tokens
    for _ in range(12):
        sizes = rng.integers(100, 2000, size=600)
        writer.add_documents(rng.integers(0, 100_000, size=int(sizes.sum()), dtype=np.int32), sizes)
    writer.finalize()
    payload = Path(tmp_path / "big.bin").stat().st_size
    assert payload > 25 << 20
    for fmt, src, dst in (("meshtron", "big", "m"), ("megatron", "m", "back")):
        tracemalloc.start()
        convert_dataset(str(tmp_path / src), str(tmp_path / dst), fmt, chunk_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < payload // 8, (fmt, peak, payload)
    assert same_bytes(tmp_path / "big.bin", tmp_path / "back.bin") and same_bytes(tmp_path / "big.idx", tmp_path / "back.idx")


def test_info_and_merge_accept_both_formats(tmp_path, capsys):
    a = write_indexed(tmp_path / "a", [[1, 2, 3], [4]], vocab_size=50)
    write_with_megatron(tmp_path / "b", [[5, 6], [7, 8, 9]], np.uint16)
    assert commands.main(["data", "info", str(tmp_path / "b"), "--verify", "--vocab-size", "50"]) == 0
    out = capsys.readouterr().out
    assert "2 documents, 5 tokens, format megatron, no sidecar, dtype uint16, vocab_size not recorded" in out
    assert "max token id 9, no checksum recorded, all ids < 50" in out
    assert commands.main(["data", "merge", "--input", a.prefix, str(tmp_path / "b"), "--output-prefix",
                          str(tmp_path / "ab"), "--format", "megatron"]) == 0
    merged = IndexedDataset(tmp_path / "ab")
    assert merged.format == "megatron" and docs_of(merged) == [[1, 2, 3], [4], [5, 6], [7, 8, 9]]
    assert [d.tolist() for d in read_with_megatron(tmp_path / "ab")] == docs_of(merged)
    assert commands.main(["data", "merge", "--input", str(tmp_path / "b"), "--output-prefix", str(tmp_path / "bm"),
                          "--format", "meshtron"]) == 2
    assert "records no vocabulary size" in capsys.readouterr().err and not list(tmp_path.glob("bm.*"))
    assert commands.main(["data", "info", str(tmp_path / "ab")]) == 0
    assert "format megatron, with sidecar, dtype uint16, vocab_size 50" in capsys.readouterr().out


def test_multimodal_index_reads_its_sequences(tmp_path):
    """A multimodal .idx ends with one int8 mode per sequence after the document indices; the tokens read
    the same (the modes are not used)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = [[1, 2, 3], [4, 5], [6]]
    builder = IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.uint16, multimodal=True)
    for k, d in enumerate(docs):
        builder.add_item(torch.tensor(d), mode=k % 2)
        builder.end_document()
    builder.finalize(str(tmp_path / "mm.idx"))
    assert docs_of(IndexedDataset(tmp_path / "mm")) == docs


def test_convert_errors_are_one_line(tmp_path, capsys):
    write_with_megatron(tmp_path / "m", [[1, 2], [3]], np.uint16)
    argv = ["data", "convert", "--input", str(tmp_path / "m"), "--output", str(tmp_path / "o"), "--format", "meshtron"]
    assert commands.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give --vocab-size N or --tokenizer" in err
    assert commands.main(argv[:-4] + ["--output", str(tmp_path / "m"), "--format", "megatron"]) == 2
    assert "is the input prefix" in capsys.readouterr().err
    assert not list(tmp_path.glob("o.*"))
