"""Megatron-LM's indexed format (`MMIDIDX`), read and written byte for byte, plus meshtron's sidecar.

    .bin  the tokens, nothing else (no header)
    .idx  magic "MMIDIDX\\0\\0" (9 B), version u64 = 1, dtype code u8, sequence count n u64,
          document count d u64, then sequence_lengths int32[n], sequence_pointers int64[n] (byte offset
          of each sequence in the .bin), document_indices int64[d] (0, then the sequence index that
          ends each document; d = documents + 1), and int8[n] sequence modes in multimodal files.

Megatron's GPTDataset cuts samples from *sequences* and never reads document_indices; meshtron does the
same: a Megatron sequence is a meshtron document (split, shuffled and sampled as one), and the grouping
is kept only so that merging and converting to Megatron's format write it back.

The format carries no vocabulary size, checksum or pairing of .idx with .bin, so meshtron writes them
to PREFIX.meshtron.json, a sidecar Megatron never opens. Without a sidecar a Megatron prefix still
opens, with every structural check the .idx allows; its vocabulary size and maximum id are unknown.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np

from meshtron.config.fields import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")      # 34 bytes
# Megatron's DType enum: the codes its writer records.
DTYPES = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
          5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
SIDECAR_SUFFIX = ".meshtron.json"
SIDECAR_KIND = "meshtron-sidecar"
CHUNK = 1 << 22   # index entries per vectorised step (bounds the memory of checks and writes)


class IndexedDatasetError(ConfigError):
    """A missing, truncated, corrupt or mismatched .bin/.idx pair (a ConfigError: one line for the user).
    Defined here, below indexed.py which re-exports it, so that both formats raise the same error."""


class MegatronFormatError(IndexedDatasetError):
    """A Megatron-format prefix that is truncated, corrupt or inconsistent."""


def sidecar_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{SIDECAR_SUFFIX}")


class TokenOffsets:
    """Token offset of every sequence start plus the end, derived from the byte pointers without
    materialising them: offsets[i] for i in [0, n] and contiguous slices, like an int64 array."""

    def __init__(self, pointers: np.ndarray, itemsize: int, num_tokens: int):
        self.pointers, self.itemsize, self.num_tokens = pointers, itemsize, num_tokens

    def __len__(self) -> int:
        return len(self.pointers) + 1

    def __getitem__(self, key):
        n = len(self.pointers)
        if isinstance(key, slice):
            start, stop, step = key.indices(n + 1)
            assert step == 1
            body = np.asarray(self.pointers[start:min(stop, n)], dtype=np.int64) // self.itemsize
            return np.append(body, self.num_tokens) if stop > n else body
        i = int(key) + (n + 1 if int(key) < 0 else 0)
        return self.num_tokens if i == n else int(self.pointers[i]) // self.itemsize


def read_index(idx_path: Path) -> dict:
    """Parse and check a Megatron .idx: header, file size, lengths against pointers, document indices."""
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise MegatronFormatError(f"{idx_path}: truncated Megatron index header ({len(raw)} of {HEADER.size} bytes); "
                                  "re-run preprocessing")
    magic, version, code, n, d = HEADER.unpack(raw)
    if version != VERSION:
        raise MegatronFormatError(f"{idx_path}: Megatron index version {version}; meshtron reads version {VERSION}")
    if code not in DTYPES:
        raise MegatronFormatError(f"{idx_path}: unknown Megatron dtype code {code} (known: 1-8); the file is corrupt")
    body = 4 * n + 8 * n + 8 * d
    if size not in (HEADER.size + body, HEADER.size + body + n):   # + n: int8 modes of a multimodal file
        raise MegatronFormatError(f"{idx_path}: {size} bytes, expected {HEADER.size + body} for {n} sequences and "
                                  f"{d} document indices (truncated or corrupt); re-run preprocessing")
    def mm(dtype, count: int, offset: int) -> np.ndarray:
        return (np.memmap(idx_path, dtype=dtype, mode="r", offset=offset, shape=(count,)) if count
                else np.zeros(0, dtype=dtype))

    lengths = mm(np.int32, n, HEADER.size)
    pointers = mm(np.int64, n, HEADER.size + 4 * n)
    doc_indices = mm(np.int64, d, HEADER.size + 12 * n)
    itemsize = DTYPES[code].itemsize
    num_tokens = _check_pointers(idx_path, lengths, pointers, itemsize)
    _check_document_indices(idx_path, doc_indices, n)
    return {"dtype": DTYPES[code], "lengths": lengths, "pointers": pointers, "document_indices": doc_indices,
            "num_tokens": num_tokens}


def _check_pointers(idx_path: Path, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> int:
    """Sequence k must start where k - 1 ends (Megatron's writer lays them out back to back) with a
    length >= 0. One vectorised pass over bounded chunks; returns the number of tokens."""
    tokens = 0
    for lo in range(0, len(lengths), CHUNK):
        chunk = np.asarray(lengths[lo:lo + CHUNK], dtype=np.int64)
        starts = tokens + np.concatenate([[0], np.cumsum(chunk[:-1])])
        bad = np.flatnonzero((chunk < 0) | (np.asarray(pointers[lo:lo + CHUNK]) != starts * itemsize))
        if len(bad):
            k = lo + int(bad[0])
            raise MegatronFormatError(f"{idx_path}: sequence {k} has length {lengths[k]} and byte pointer "
                                      f"{pointers[k]}, expected {int(starts[bad[0]]) * itemsize} (sequence lengths and "
                                      "pointers disagree: corrupt); re-run preprocessing")
        tokens += int(chunk.sum())
    return tokens


def _check_document_indices(idx_path: Path, doc_indices: np.ndarray, n: int) -> None:
    if len(doc_indices) == 0 or doc_indices[0] != 0 or doc_indices[-1] != n:
        first = doc_indices[0] if len(doc_indices) else "none"
        last = doc_indices[-1] if len(doc_indices) else "none"
        raise MegatronFormatError(f"{idx_path}: document indices run from {first} to {last}, not from 0 to {n} "
                                  "sequences (corrupt); re-run preprocessing")
    for lo in range(0, len(doc_indices) - 1, CHUNK):
        bad = np.flatnonzero(np.diff(doc_indices[lo:lo + CHUNK + 1]) < 0)
        if len(bad):
            raise MegatronFormatError(f"{idx_path}: document indices decrease at entry {lo + int(bad[0]) + 1} "
                                      "(corrupt); re-run preprocessing")


def _chunks(array, size: int = CHUNK):
    for lo in range(0, len(array), size):
        yield np.asarray(array[lo:lo + size])


def write_index(path: Path, dtype: np.dtype, lengths, document_indices=None) -> int:
    """Write a Megatron .idx exactly as megatron-core's IndexedDatasetBuilder does, streaming over
    `lengths` (any sliceable int array: an in-memory array or a memory map) in bounded chunks.
    document_indices None means one sequence per document (0, 1, ..., n). Returns the file's crc32."""
    n = len(lengths)
    d = n + 1 if document_indices is None else len(document_indices)
    crc = 0
    with open(path, "wb") as f:
        def put(data: bytes) -> None:
            nonlocal crc
            f.write(data)
            crc = zlib.crc32(data, crc)

        put(HEADER.pack(MAGIC, VERSION, DTYPE_CODES[np.dtype(dtype)], n, d))
        for chunk in _chunks(lengths):
            put(chunk.astype(np.int32).tobytes())
        tokens = 0
        for chunk in _chunks(lengths):
            ends = tokens + np.cumsum(chunk, dtype=np.int64)
            put(((ends - chunk) * np.dtype(dtype).itemsize).astype(np.int64).tobytes())
            tokens = int(ends[-1])
        if document_indices is None:
            for lo in range(0, n + 1, CHUNK):
                put(np.arange(lo, min(lo + CHUNK, n + 1), dtype=np.int64).tobytes())
        else:
            for chunk in _chunks(document_indices):
                put(chunk.astype(np.int64).tobytes())
    return crc


def file_crc32(path: Path, block: int = 1 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while data := f.read(block):
            crc = zlib.crc32(data, crc)
    return crc


def write_sidecar(path: Path, *, pair_id: bytes, vocab_size: int | None, num_tokens: int, num_sequences: int,
                  dtype: np.dtype, crc: int, max_token_id: int | None, idx_crc: int) -> None:
    record = {"kind": SIDECAR_KIND, "version": 1, "pair_id": pair_id.hex(), "vocab_size": vocab_size,
              "num_tokens": num_tokens, "num_sequences": num_sequences, "dtype": np.dtype(dtype).name,
              "crc32": crc, "max_token_id": max_token_id, "idx_crc32": idx_crc}
    path.write_text(json.dumps(record, indent=1) + "\n")


def read_sidecar(prefix: str, idx_path: Path, *, dtype: np.dtype, num_tokens: int, num_sequences: int) -> dict | None:
    """The sidecar's record when PREFIX.meshtron.json exists, checked against the .idx it claims."""
    path = sidecar_path(prefix)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        expected = {"kind": SIDECAR_KIND, "version": 1, "dtype": np.dtype(dtype).name, "num_tokens": num_tokens,
                    "num_sequences": num_sequences}
        fields = ("pair_id", "vocab_size", "crc32", "max_token_id", "idx_crc32")
        ok = isinstance(record, dict) and all(k in record for k in fields)
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise MegatronFormatError(f"{path}: not a meshtron sidecar (unreadable JSON or missing fields); delete it "
                                  "(the Megatron .bin/.idx open without it) or convert the dataset again")
    wrong = [k for k, v in expected.items() if record.get(k) != v]
    if wrong or record["idx_crc32"] != file_crc32(idx_path):
        what = ", ".join(wrong) if wrong else "the .idx checksum"
        raise MegatronFormatError(f"{path}: does not belong to {idx_path} ({what} differ); the .idx was rewritten "
                                  "after the sidecar: delete the sidecar, or convert the dataset again")
    vocab, max_id = record["vocab_size"], record["max_token_id"]
    if vocab is not None and max_id is not None and max_id >= vocab:
        raise MegatronFormatError(f"{path}: records a maximum token id {max_id} outside its own vocab_size {vocab} "
                                  "(corrupt); delete it or convert the dataset again")
    record["pair_id"] = bytes.fromhex(record["pair_id"])
    return record
