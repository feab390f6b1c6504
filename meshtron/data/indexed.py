"""The indexed dataset format: `PREFIX.bin` (tokens) + `PREFIX.idx` (document boundaries), read
through numpy memory maps so a dataset of any size opens instantly and costs no RAM up front.

    .bin  header (32 B): magic "MSHTBIN\\0", version u32, dtype code u32, pair id (16 random bytes)
          then num_tokens tokens of the dtype (uint16 when the vocabulary fits, else int32)
    .idx  header (64 B): magic "MSHTIDX\\0", version u32, dtype code u32, pair id, num_docs u64,
          num_tokens u64, vocab_size u64, crc32 of the token bytes u32, max token id + 1 u32 (0: not recorded)
          then offsets int64[num_docs + 1] (token offset of each document start) and sizes int32[num_docs]

The pair id ties a .idx to the .bin written with it, so a mismatched pair is refused; file sizes,
offsets and sizes are cross-checked on open (vectorised), every read refuses ids >= `id_limit`, and
`verify()` scans the tokens (checksum, maximum id).
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np

from meshtron.config.fields import ConfigError

VERSION = 1
BIN_MAGIC, IDX_MAGIC = b"MSHTBIN\x00", b"MSHTIDX\x00"
BIN_HEADER = struct.Struct("<8sII16s")            # 32 bytes
# The last u32 was reserved (0) before the maximum id was recorded there, so older files read as "not recorded".
IDX_HEADER = struct.Struct("<8sII16sQQQII")       # 64 bytes
DTYPES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
CHECK_ENTRIES = 1 << 22   # index entries per vectorised step of the open-time check (bounds its memory)
SCAN_BYTES = 16 << 20     # .bin bytes per step of a full scan


class IndexedDatasetError(ConfigError):
    """A missing, truncated, corrupt or mismatched .bin/.idx pair (a ConfigError: one line for the user)."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 halves the file size whenever every id fits; int32 otherwise."""
    return DTYPES[1] if vocab_size <= 1 << 16 else DTYPES[2]


def paths_of(prefix: str | Path) -> tuple[Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


class IndexedDatasetWriter:
    """Appends documents to PREFIX.bin/.idx; files appear under their final names only on `finalize()`."""

    def __init__(self, prefix: str | Path, vocab_size: int):
        self.prefix, self.vocab_size = str(prefix), int(vocab_size)
        self.dtype = dtype_for_vocab(vocab_size)
        self.pair_id = os.urandom(16)
        self.bin_path, self.idx_path = paths_of(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + ".partial")
        self._file = open(self._tmp_bin, "wb")
        self._file.write(BIN_HEADER.pack(BIN_MAGIC, VERSION, DTYPE_CODES[self.dtype], self.pair_id))
        self._sizes: list[np.ndarray] = []
        self.num_tokens, self.crc, self.max_id = 0, 0, -1

    def add_documents(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        """tokens: all documents concatenated; sizes: (num_docs,) their lengths."""
        assert int(np.sum(sizes)) == len(tokens)
        if len(tokens):
            if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
                raise IndexedDatasetError(f"{self.prefix}: token id outside [0, {self.vocab_size}); "
                                          "the tokenizer's vocab_size is wrong for its ids")
            self.max_id = max(self.max_id, int(tokens.max()))
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.num_tokens += len(tokens)
        self._sizes.append(np.asarray(sizes, dtype=np.int32))

    def add_document(self, tokens) -> None:
        arr = np.asarray(tokens)
        self.add_documents(arr, np.array([len(arr)], dtype=np.int32))

    def add_raw(self, prefix: str | Path) -> None:
        """Append every document of another dataset by copying bytes (used by merge)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype or other.vocab_size != self.vocab_size:
            raise IndexedDatasetError(f"{prefix}: vocab_size {other.vocab_size} ({other.dtype}) differs from "
                                      f"{self.vocab_size} ({self.dtype}); merge only datasets of one tokenizer")
        with open(paths_of(prefix)[0], "rb") as f:
            f.seek(BIN_HEADER.size)
            while chunk := f.read(SCAN_BYTES):
                self._file.write(chunk)
                self.crc = zlib.crc32(chunk, self.crc)
                # Taken from the bytes themselves, so merging a dataset without a recorded maximum records one.
                self.max_id = max(self.max_id, int(np.frombuffer(chunk, dtype=self.dtype).max()))
        self.num_tokens += other.num_tokens
        self._sizes.append(np.array(other.sizes, dtype=np.int32))

    def finalize(self) -> None:
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int32)
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        assert offsets[-1] == self.num_tokens
        self._file.close()
        tmp_idx = self.idx_path.with_name(self.idx_path.name + ".partial")
        with open(tmp_idx, "wb") as f:
            f.write(IDX_HEADER.pack(IDX_MAGIC, VERSION, DTYPE_CODES[self.dtype], self.pair_id, len(sizes),
                                    self.num_tokens, self.vocab_size, self.crc, self.max_id + 1))
            f.write(offsets.tobytes())
            f.write(sizes.tobytes())
        # The .idx is renamed last: its presence means the pair is complete.
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, self.idx_path)

    def abort(self) -> None:
        self._file.close()
        self._tmp_bin.unlink(missing_ok=True)


class IndexedDataset:
    """Random access to documents (and slices of them) of a finished PREFIX.bin/.idx pair.

    `max_token_id` is the largest id recorded at preprocess time (None for files written before it
    was recorded); every read refuses an id >= `id_limit` (the header's vocab_size unless a caller
    such as training sets a smaller one), so a corrupted .bin never hands out an id the model lacks.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        bin_path, idx_path = paths_of(prefix)
        for p in (bin_path, idx_path):
            if not p.is_file():
                raise IndexedDatasetError(f"{p}: not found; create it with `meshtron preprocess --output-prefix {prefix}`")
        code, pair_id, num_docs, num_tokens = self._read_idx_header(idx_path)
        expected_bin = BIN_HEADER.size + num_tokens * self.dtype.itemsize
        with open(bin_path, "rb") as f:
            bin_header = f.read(BIN_HEADER.size)
        if len(bin_header) < BIN_HEADER.size or BIN_HEADER.unpack(bin_header) != (BIN_MAGIC, VERSION, code, pair_id):
            raise IndexedDatasetError(f"{bin_path}: does not belong to {idx_path} (different header or pair id); "
                                      "keep the .bin and .idx written together")
        if bin_path.stat().st_size != expected_bin:
            raise IndexedDatasetError(f"{bin_path}: {bin_path.stat().st_size} bytes, expected {expected_bin} "
                                      f"for {num_tokens} tokens (truncated or corrupt); re-run preprocessing")
        self.offsets = np.memmap(idx_path, dtype=np.int64, mode="r", offset=IDX_HEADER.size, shape=(num_docs + 1,))
        self.sizes = (np.memmap(idx_path, dtype=np.int32, mode="r", offset=IDX_HEADER.size + 8 * (num_docs + 1),
                                shape=(num_docs,)) if num_docs else np.zeros(0, dtype=np.int32))
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r", offset=BIN_HEADER.size, shape=(num_tokens,))
                       if num_tokens else np.zeros(0, dtype=self.dtype))
        check_offsets(idx_path, self.offsets, self.sizes, num_tokens)

    def _read_idx_header(self, idx_path: Path) -> tuple[int, bytes, int, int]:
        """Read and check the .idx header and size; sets dtype, counts, vocab_size, crc and the max id."""
        with open(idx_path, "rb") as f:
            raw = f.read(IDX_HEADER.size)
        if len(raw) < IDX_HEADER.size:
            raise IndexedDatasetError(f"{idx_path}: truncated header; re-run preprocessing")
        magic, version, code, pair_id, num_docs, num_tokens, vocab_size, crc, max_id_plus_1 = IDX_HEADER.unpack(raw)
        if magic != IDX_MAGIC or version != VERSION or code not in DTYPES:
            raise IndexedDatasetError(f"{idx_path}: not a meshtron index (version {VERSION}); re-run preprocessing")
        if max_id_plus_1 > vocab_size:
            raise IndexedDatasetError(f"{idx_path}: records a maximum token id {max_id_plus_1 - 1} outside its own "
                                      f"vocab_size {vocab_size} (corrupt header); re-run preprocessing")
        self.dtype, self.num_docs, self.num_tokens = DTYPES[code], num_docs, num_tokens
        self.vocab_size, self.crc = vocab_size, crc
        self.max_token_id = max_id_plus_1 - 1 if max_id_plus_1 else None
        self.id_limit = vocab_size
        expected_idx = IDX_HEADER.size + 8 * (num_docs + 1) + 4 * num_docs
        if idx_path.stat().st_size != expected_idx:
            raise IndexedDatasetError(f"{idx_path}: {idx_path.stat().st_size} bytes, expected {expected_idx} "
                                      "(truncated or corrupt); re-run preprocessing")
        return code, pair_id, num_docs, num_tokens

    def __len__(self) -> int:
        return self.num_docs

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.num_docs <= i < self.num_docs:
            raise IndexError(f"document {i} of {self.num_docs}")
        i %= max(self.num_docs, 1)
        return self._checked(self.tokens[self.offsets[i]:self.offsets[i + 1]], i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document i (to its end when length is None)."""
        start = int(self.offsets[i]) + offset
        end = int(self.offsets[i + 1]) if length is None else start + length
        assert start <= end <= self.offsets[i + 1]
        return self._checked(self.tokens[start:end], i)

    def _checked(self, tokens: np.ndarray, doc: int) -> np.ndarray:
        # One max over tokens about to be copied anyway: what stands between a flipped byte and the embedding.
        if len(tokens) and int(tokens.max()) >= self.id_limit:
            raise IndexedDatasetError(f"{self.prefix}.bin: document {doc} holds token id {int(tokens.max())}, outside "
                                      f"the vocabulary of {self.id_limit} ids (corrupt, or preprocessed for another "
                                      f"tokenizer); check it with `meshtron data info {self.prefix} --verify`")
        return tokens

    def verify(self, vocab_size: int | None = None) -> int | None:
        """Scan every token: recompute the checksum and the maximum id, and refuse ids >= vocab_size (the
        header's by default). Returns the maximum id (None when there are no tokens)."""
        limit = self.vocab_size if vocab_size is None else vocab_size
        crc, max_id, num_bad, first_bad = 0, -1, 0, -1
        with open(paths_of(self.prefix)[0], "rb") as f:
            f.seek(BIN_HEADER.size)
            position = 0
            while chunk := f.read(SCAN_BYTES):
                crc = zlib.crc32(chunk, crc)
                ids = np.frombuffer(chunk, dtype=self.dtype)
                max_id = max(max_id, int(ids.max()))
                bad = np.flatnonzero(ids >= limit)
                if len(bad) and first_bad < 0:
                    first_bad = position + int(bad[0])
                num_bad, position = num_bad + len(bad), position + len(ids)
        if crc != self.crc:
            raise IndexedDatasetError(f"{self.prefix}.bin: checksum {crc:#010x} differs from the index's "
                                      f"{self.crc:#010x} (corrupt); re-run preprocessing")
        if self.max_token_id is not None and max_id != self.max_token_id:
            raise IndexedDatasetError(f"{self.prefix}.bin: maximum token id {max_id} differs from the {self.max_token_id} "
                                      "recorded in the index (corrupt); re-run preprocessing")
        if num_bad:
            doc = int(np.searchsorted(self.offsets, first_bad, side="right")) - 1
            raise IndexedDatasetError(f"{self.prefix}.bin: {num_bad} token ids >= vocab size {limit} (maximum id {max_id}, "
                                      f"first in document {doc}); preprocess with the model's tokenizer, or give the "
                                      f"model a vocabulary of at least {max_id + 1}")
        return max_id if max_id >= 0 else None


def check_offsets(idx_path: Path, offsets: np.ndarray, sizes: np.ndarray, num_tokens: int) -> None:
    """Document k must span offsets[k]..offsets[k + 1] = sizes[k] >= 0 tokens, from 0 to num_tokens.
    Vectorised over bounded chunks of the memory-mapped index: one pass, no loop over documents."""
    if offsets[0] != 0 or offsets[-1] != num_tokens:
        raise IndexedDatasetError(f"{idx_path}: document offsets run from {offsets[0]} to {offsets[-1]}, not from 0 "
                                  f"to {num_tokens} tokens (corrupt); re-run preprocessing")
    for lo in range(0, len(sizes), CHECK_ENTRIES):
        span = np.diff(offsets[lo:lo + CHECK_ENTRIES + 1])
        bad = np.flatnonzero((span != sizes[lo:lo + CHECK_ENTRIES]) | (span < 0))
        if len(bad):
            k = lo + int(bad[0])
            raise IndexedDatasetError(f"{idx_path}: document {k} has size {sizes[k]} but offsets {offsets[k]}.."
                                      f"{offsets[k + 1]} (sizes and offsets disagree: corrupt); re-run preprocessing")


def merge_datasets(prefixes: list[str], output_prefix: str | Path, *, verify: bool = True) -> IndexedDataset:
    """Concatenate datasets in the given order into OUTPUT_PREFIX (documents keep their order)."""
    if not prefixes:
        raise IndexedDatasetError("data merge: give at least one input prefix")
    first = IndexedDataset(prefixes[0])
    writer = IndexedDatasetWriter(output_prefix, first.vocab_size)
    try:
        for prefix in prefixes:
            if verify:
                IndexedDataset(prefix).verify()
            writer.add_raw(prefix)
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    return IndexedDataset(output_prefix)

