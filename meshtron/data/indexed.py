"""Indexed datasets: `PREFIX.bin` (tokens) + `PREFIX.idx` (document boundaries), in meshtron's format or
Megatron-LM's (see megatron_format.py), told apart by the .idx magic and read through numpy memory maps,
so a dataset of any size opens instantly and costs no RAM up front.

meshtron's format:
    .bin  header (32 B): magic "MSHTBIN\\0", version u32, dtype code u32, pair id (16 random bytes)
          then num_tokens tokens of the dtype (uint16 when the vocabulary fits, else int32)
    .idx  header (64 B): magic "MSHTIDX\\0", version u32, dtype code u32, pair id, num_docs u64,
          num_tokens u64, vocab_size u64, crc32 of the token bytes u32, max token id + 1 u32 (0: not recorded)
          then offsets int64[num_docs + 1] (token offset of each document start) and sizes int32[num_docs]
Megatron's format holds the same token bytes; meshtron puts the pair id, vocab size, checksum and
maximum id into the sidecar PREFIX.meshtron.json.

The pair id ties a .idx to its .bin (meshtron's headers, or the sidecar's .idx checksum), so a mismatched
pair is refused; file sizes, offsets and sizes are cross-checked on open (vectorised), every read
refuses ids outside [0, `id_limit`), and `verify()` scans the tokens (checksum, maximum id).
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np

from meshtron.data import megatron_format as mf
from meshtron.data.megatron_format import IndexedDatasetError

VERSION = 1
BIN_MAGIC, IDX_MAGIC = b"MSHTBIN\x00", b"MSHTIDX\x00"
BIN_HEADER = struct.Struct("<8sII16s")            # 32 bytes
# The last u32 was reserved (0) before the maximum id was recorded there, so older files read as "not recorded".
IDX_HEADER = struct.Struct("<8sII16sQQQII")       # 64 bytes
DTYPES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
FORMATS = ("megatron", "meshtron")
DEFAULT_FORMAT = "megatron"   # what `meshtron preprocess` writes unless told otherwise
CHECK_ENTRIES = 1 << 22   # index entries per vectorised step of the open-time check (bounds its memory)
SCAN_BYTES = 16 << 20     # .bin bytes per step of a full scan or copy


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 halves the file size whenever every id fits; int32 otherwise."""
    return DTYPES[1] if vocab_size <= 1 << 16 else DTYPES[2]


def paths_of(prefix: str | Path) -> tuple[Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def check_format(name: str, field: str = "--format") -> str:
    if name not in FORMATS:
        raise IndexedDatasetError(f"{field}: {name!r} is not allowed; choose one of {', '.join(FORMATS)}")
    return name


def _dtype_bounds(dtype: np.dtype) -> tuple[int, int]:
    """The smallest and one past the largest id a token of this dtype can hold."""
    if dtype.kind == "f":
        return -(1 << np.finfo(dtype).nmant + 1), 1 << np.finfo(dtype).nmant + 1
    info = np.iinfo(dtype)
    return int(info.min), int(info.max) + 1


def _ids_of(chunk: bytes, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(chunk, dtype=dtype)


class IndexedDatasetWriter:
    """Appends documents to PREFIX.bin/.idx (and the sidecar, in Megatron's format); files appear under
    their final names only on `finalize()`, the .idx last. vocab_size None (allowed in Megatron's format
    only) records no vocabulary; `dtype` overrides the one chosen from vocab_size (conversions keep theirs)."""

    def __init__(self, prefix: str | Path, vocab_size: int | None, format: str = DEFAULT_FORMAT,
                 dtype: np.dtype | None = None, pair_id: bytes | None = None):
        self.prefix, self.format = str(prefix), check_format(format)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        if self.vocab_size is None and (format == "meshtron" or dtype is None):
            raise IndexedDatasetError(f"{prefix}: a vocabulary size is needed to write meshtron's format; give "
                                      "--vocab-size or --tokenizer")
        self.dtype = np.dtype(dtype) if dtype is not None else dtype_for_vocab(self.vocab_size)
        if (format == "meshtron" and self.dtype not in DTYPE_CODES) or self.dtype not in mf.DTYPE_CODES:
            raise IndexedDatasetError(f"{prefix}: {format}'s format cannot hold {self.dtype} tokens")
        self.pair_id = pair_id or os.urandom(16)
        self.bin_path, self.idx_path = paths_of(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + ".partial")
        self._file = open(self._tmp_bin, "wb")
        if format == "meshtron":
            self._file.write(BIN_HEADER.pack(BIN_MAGIC, VERSION, DTYPE_CODES[self.dtype], self.pair_id))
        self._sizes: list[np.ndarray] = []
        # (first sequence, count, Megatron document indices or None for one document per sequence)
        self._groups: list[tuple[int, int, np.ndarray | None]] = []
        self.num_sequences, self.num_tokens, self.crc, self.max_id = 0, 0, 0, -1
        self.id_bounds = (0, self.vocab_size if self.vocab_size is not None else _dtype_bounds(self.dtype)[1])

    def add_payload(self, ids: np.ndarray) -> None:
        """Append token ids without document boundaries (the sizes come in `add_sizes` or `finalize`)."""
        if len(ids):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < self.id_bounds[0] or hi >= self.id_bounds[1]:
                bad = lo if lo < self.id_bounds[0] else hi
                raise IndexedDatasetError(f"{self.prefix}: token id {bad} outside [0, {self.id_bounds[1]}); the "
                                          "tokenizer's vocab_size is wrong for its ids (or the input is corrupt)")
            if ids.dtype.kind == "f" and not np.array_equal(ids, np.floor(ids)):
                raise IndexedDatasetError(f"{self.prefix}: a token id is not a whole number (floating-point tokens "
                                          "that are not integers: corrupt input)")
            self.max_id = max(self.max_id, hi)
        data = ids.tobytes() if ids.dtype == self.dtype else np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self._file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.num_tokens += len(ids)

    def add_sizes(self, sizes: np.ndarray, document_indices: np.ndarray | None = None) -> None:
        sizes = np.asarray(sizes, dtype=np.int32)
        self._sizes.append(sizes)
        grouped = None if document_indices is None else np.asarray(document_indices, dtype=np.int64)
        self._groups.append((self.num_sequences, len(sizes), grouped))
        self.num_sequences += len(sizes)

    def add_documents(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        """tokens: all documents concatenated; sizes: (num_docs,) their lengths."""
        assert int(np.sum(sizes)) == len(tokens)
        self.add_payload(np.asarray(tokens))
        self.add_sizes(sizes)

    def add_document(self, tokens) -> None:
        arr = np.asarray(tokens)
        self.add_documents(arr, np.array([len(arr)], dtype=np.int32))

    def add_raw(self, prefix: str | Path) -> None:
        """Append every document of another dataset (either format) by copying its token bytes (merge)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype or (other.vocab_size is not None and other.vocab_size != self.vocab_size):
            raise IndexedDatasetError(f"{prefix}: vocab_size {other.vocab_size} ({other.dtype}) differs from "
                                      f"{self.vocab_size} ({self.dtype}); merge only datasets of one tokenizer")
        for ids in iter_token_chunks(other):
            # Taken from the bytes themselves, so merging a dataset without a recorded maximum records one.
            self.add_payload(ids)
        self.add_sizes(other.sizes, other.document_indices if other.grouped else None)

    def _document_indices(self) -> np.ndarray | None:
        if all(g is None for _, _, g in self._groups):
            return None
        parts = [np.zeros(1, dtype=np.int64)]
        for first, count, grouped in self._groups:
            parts.append(first + (np.arange(1, count + 1, dtype=np.int64) if grouped is None else grouped[1:]))
        return np.concatenate(parts)

    def finalize(self, sizes=None, document_indices=None) -> None:
        """Write the index. `sizes` (and Megatron `document_indices`) given here, e.g. memory maps of a
        dataset being converted, are streamed in chunks instead of the ones collected by add_sizes."""
        if sizes is None:
            sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int32)
            document_indices = self._document_indices()
        self._file.close()
        tmp_idx = self.idx_path.with_name(self.idx_path.name + ".partial")
        sidecar = mf.sidecar_path(self.prefix)
        tmp_sidecar = sidecar.with_name(sidecar.name + ".partial")
        if self.format == "meshtron":
            total = write_meshtron_index(tmp_idx, self, sizes)
        else:
            idx_crc = mf.write_index(tmp_idx, self.dtype, sizes, document_indices)
            total = self.num_tokens
            mf.write_sidecar(tmp_sidecar, pair_id=self.pair_id, vocab_size=self.vocab_size, num_tokens=self.num_tokens,
                             num_sequences=len(sizes), dtype=self.dtype, crc=self.crc,
                             max_token_id=self.max_id if self.max_id >= 0 else None, idx_crc=idx_crc)
        assert total == self.num_tokens, (total, self.num_tokens)
        # The .idx is renamed last: its presence means the pair is complete.
        os.replace(self._tmp_bin, self.bin_path)
        if self.format == "megatron":
            os.replace(tmp_sidecar, sidecar)
        else:
            sidecar.unlink(missing_ok=True)   # a stale sidecar of an earlier Megatron-format write
        os.replace(tmp_idx, self.idx_path)

    def abort(self) -> None:
        self._file.close()
        sidecar = mf.sidecar_path(self.prefix)
        for tmp in (self._tmp_bin, self.idx_path.with_name(self.idx_path.name + ".partial"),
                    sidecar.with_name(sidecar.name + ".partial")):
            tmp.unlink(missing_ok=True)


def write_meshtron_index(path: Path, writer: IndexedDatasetWriter, sizes) -> int:
    """meshtron's .idx: header, offsets, sizes, streamed over `sizes` in bounded chunks. Returns the token count."""
    n = len(sizes)
    with open(path, "wb") as f:
        f.write(IDX_HEADER.pack(IDX_MAGIC, VERSION, DTYPE_CODES[writer.dtype], writer.pair_id, n, writer.num_tokens,
                                writer.vocab_size, writer.crc, writer.max_id + 1))
        f.write(np.zeros(1, dtype=np.int64).tobytes())
        total = 0
        for lo in range(0, n, CHECK_ENTRIES):
            ends = total + np.cumsum(np.asarray(sizes[lo:lo + CHECK_ENTRIES]), dtype=np.int64)
            f.write(ends.tobytes())
            total = int(ends[-1])
        for lo in range(0, n, CHECK_ENTRIES):
            f.write(np.asarray(sizes[lo:lo + CHECK_ENTRIES], dtype=np.int32).tobytes())
    return total


def iter_token_chunks(ds: IndexedDataset, chunk_bytes: int = SCAN_BYTES):
    """The dataset's token ids in order, read from its .bin in chunks of about chunk_bytes."""
    step = max(1, chunk_bytes // ds.dtype.itemsize) * ds.dtype.itemsize
    with open(paths_of(ds.prefix)[0], "rb") as f:
        f.seek(ds.data_offset)
        while chunk := f.read(step):
            yield _ids_of(chunk, ds.dtype)


class IndexedDataset:
    """Random access to documents (and slices of them) of a finished PREFIX.bin/.idx pair, either format.

    `format` is "meshtron" or "megatron". A Megatron sequence is a document here (as in Megatron's
    GPTDataset); `document_indices` keeps Megatron's grouping of sequences (0, 1, ..., n when ungrouped)
    and `grouped` says whether any document holds several sequences. `vocab_size`, `crc` and
    `max_token_id` are None when not recorded (a Megatron prefix without sidecar, an older meshtron
    file). Every read refuses an id outside [0, `id_limit`) (the vocab_size unless a caller such as
    training sets a smaller one), so a corrupted .bin never hands out an id the model lacks.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        bin_path, idx_path = paths_of(prefix)
        for p in (bin_path, idx_path):
            if not p.is_file():
                raise IndexedDatasetError(f"{p}: not found; create it with `meshtron preprocess --output-prefix {prefix}`")
        with open(idx_path, "rb") as f:
            magic = f.read(len(mf.MAGIC))
        if magic.startswith(IDX_MAGIC):
            offsets, sizes = self._open_meshtron(bin_path, idx_path)
        elif magic == mf.MAGIC:
            offsets, sizes = self._open_megatron(bin_path, idx_path)
        else:
            raise IndexedDatasetError(f"{idx_path}: starts with {magic!r}, neither meshtron's {IDX_MAGIC!r} nor "
                                      f"Megatron's {mf.MAGIC!r} index magic (not an index, or corrupt); re-run preprocessing")
        self.offsets = offsets   # (num_docs + 1,) token offsets: an int64 memory map, or Megatron's pointers / itemsize
        self.sizes = sizes       # (num_docs,) int32 document lengths
        self.tokens = self._map_tokens(bin_path)
        if self.format == "meshtron":
            check_offsets(idx_path, self.offsets, self.sizes, self.num_tokens)
        self.id_limit = self.vocab_size if self.vocab_size is not None else _dtype_bounds(self.dtype)[1]
        self._signed = self.dtype.kind != "u"

    def _open_meshtron(self, bin_path: Path, idx_path: Path) -> tuple[np.ndarray, np.ndarray]:
        self.format, self.data_offset = "meshtron", BIN_HEADER.size
        code, pair_id, num_docs, num_tokens = self._read_idx_header(idx_path)
        self.pair_id = pair_id
        expected_bin = BIN_HEADER.size + num_tokens * self.dtype.itemsize
        with open(bin_path, "rb") as f:
            bin_header = f.read(BIN_HEADER.size)
        if len(bin_header) < BIN_HEADER.size or BIN_HEADER.unpack(bin_header) != (BIN_MAGIC, VERSION, code, pair_id):
            raise IndexedDatasetError(f"{bin_path}: does not belong to {idx_path} (different header or pair id); "
                                      "keep the .bin and .idx written together")
        self._check_bin_size(bin_path, expected_bin, num_tokens)
        self.document_indices, self.grouped, self.has_sidecar = np.arange(num_docs + 1, dtype=np.int64), False, False
        offsets = np.memmap(idx_path, dtype=np.int64, mode="r", offset=IDX_HEADER.size, shape=(num_docs + 1,))
        sizes = (np.memmap(idx_path, dtype=np.int32, mode="r", offset=IDX_HEADER.size + 8 * (num_docs + 1),
                           shape=(num_docs,)) if num_docs else np.zeros(0, dtype=np.int32))
        return offsets, sizes

    def _read_idx_header(self, idx_path: Path) -> tuple[int, bytes, int, int]:
        """Read and check meshtron's .idx header and size; sets dtype, counts, vocab_size, crc and the max id."""
        with open(idx_path, "rb") as f:
            raw = f.read(IDX_HEADER.size)
        if len(raw) < IDX_HEADER.size:
            raise IndexedDatasetError(f"{idx_path}: truncated header; re-run preprocessing")
        magic, version, code, pair_id, num_docs, num_tokens, vocab_size, crc, max_id_plus_1 = IDX_HEADER.unpack(raw)
        if version != VERSION:
            raise IndexedDatasetError(f"{idx_path}: meshtron index version {version}; this meshtron reads version "
                                      f"{VERSION}: re-run preprocessing")
        if code not in DTYPES:
            raise IndexedDatasetError(f"{idx_path}: unknown meshtron dtype code {code} (corrupt); re-run preprocessing")
        if max_id_plus_1 > vocab_size:
            raise IndexedDatasetError(f"{idx_path}: records a maximum token id {max_id_plus_1 - 1} outside its own "
                                      f"vocab_size {vocab_size} (corrupt header); re-run preprocessing")
        self.dtype, self.num_docs, self.num_tokens = DTYPES[code], num_docs, num_tokens
        self.vocab_size, self.crc = vocab_size, crc
        self.max_token_id = max_id_plus_1 - 1 if max_id_plus_1 else None
        expected_idx = IDX_HEADER.size + 8 * (num_docs + 1) + 4 * num_docs
        if idx_path.stat().st_size != expected_idx:
            raise IndexedDatasetError(f"{idx_path}: {idx_path.stat().st_size} bytes, expected {expected_idx} "
                                      "(truncated or corrupt); re-run preprocessing")
        return code, pair_id, num_docs, num_tokens

    def _open_megatron(self, bin_path: Path, idx_path: Path) -> tuple[mf.TokenOffsets, np.ndarray]:
        self.format, self.data_offset = "megatron", 0
        index = mf.read_index(idx_path)
        self.dtype, self.num_tokens = index["dtype"], index["num_tokens"]
        self.num_docs = len(index["lengths"])
        self.document_indices = index["document_indices"]
        self.grouped = len(self.document_indices) != self.num_docs + 1
        self._check_bin_size(bin_path, self.num_tokens * self.dtype.itemsize, self.num_tokens)
        side = mf.read_sidecar(self.prefix, idx_path, dtype=self.dtype, num_tokens=self.num_tokens,
                               num_sequences=self.num_docs)
        self.has_sidecar = side is not None
        self.vocab_size = side["vocab_size"] if side else None
        self.crc = side["crc32"] if side else None
        self.max_token_id = side["max_token_id"] if side else None
        self.pair_id = side["pair_id"] if side else None
        return mf.TokenOffsets(index["pointers"], self.dtype.itemsize, self.num_tokens), index["lengths"]

    def _check_bin_size(self, bin_path: Path, expected: int, num_tokens: int) -> None:
        if bin_path.stat().st_size != expected:
            raise IndexedDatasetError(f"{bin_path}: {bin_path.stat().st_size} bytes, expected {expected} "
                                      f"for {num_tokens} tokens (truncated or corrupt); re-run preprocessing")

    def _map_tokens(self, bin_path: Path) -> np.ndarray:
        if not self.num_tokens:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(bin_path, dtype=self.dtype, mode="r", offset=self.data_offset, shape=(self.num_tokens,))

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
        if len(tokens):
            bad = int(tokens.max()) if tokens.max() >= self.id_limit else None
            if bad is None and self._signed and tokens.min() < 0:
                bad = int(tokens.min())
            if bad is not None:
                raise IndexedDatasetError(f"{self.prefix}.bin: document {doc} holds token id {bad}, outside the "
                                          f"vocabulary of {self.id_limit} ids (corrupt, or preprocessed for another "
                                          f"tokenizer); check it with `meshtron data info {self.prefix} --verify`")
        return tokens

    def document_at(self, position: int) -> int:
        """The document holding global token `position` (chunked search; no full offsets array)."""
        for lo in range(0, self.num_docs, CHECK_ENTRIES):
            ends = np.asarray(self.offsets[lo + 1:lo + CHECK_ENTRIES + 1])
            if len(ends) and ends[-1] > position:
                return lo + int(np.searchsorted(ends, position, side="right"))
        return self.num_docs - 1

    def verify(self, vocab_size: int | None = None) -> int | None:
        """Scan every token: recompute the checksum and the maximum id (checked against what the index
        or sidecar records, when it does), and refuse ids outside [0, vocab_size) (the recorded vocabulary
        by default). Returns the maximum id (None when there are no tokens)."""
        limit = self.vocab_size if vocab_size is None else vocab_size
        crc, max_id, min_id, num_bad, first_bad, position = 0, -1, 0, 0, -1, 0
        for ids in iter_token_chunks(self):
            crc = zlib.crc32(memoryview(ids).cast("B"), crc)
            max_id, min_id = max(max_id, int(ids.max())), min(min_id, int(ids.min()))
            bad = np.flatnonzero((ids < 0) | (ids >= limit)) if limit is not None else np.flatnonzero(ids < 0)
            if len(bad) and first_bad < 0:
                first_bad = position + int(bad[0])
            num_bad, position = num_bad + len(bad), position + len(ids)
        if self.crc is not None and crc != self.crc:
            raise IndexedDatasetError(f"{self.prefix}.bin: checksum {crc:#010x} differs from the recorded "
                                      f"{self.crc:#010x} (corrupt); re-run preprocessing")
        if self.max_token_id is not None and max_id != self.max_token_id:
            raise IndexedDatasetError(f"{self.prefix}.bin: maximum token id {max_id} differs from the {self.max_token_id} "
                                      "recorded in the index (corrupt); re-run preprocessing")
        if num_bad:
            doc = self.document_at(first_bad)
            what = (f">= vocab size {limit} (maximum id {max_id}" if min_id >= 0 else
                    f"outside [0, {limit}) (ids {min_id}..{max_id}" if limit is not None else f"< 0 (minimum id {min_id}")
            raise IndexedDatasetError(f"{self.prefix}.bin: {num_bad} token ids {what}, first in document {doc}); "
                                      "preprocess with the model's tokenizer, or give the model a vocabulary of at "
                                      f"least {max_id + 1}")
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


def merge_datasets(prefixes: list[str], output_prefix: str | Path, *, verify: bool = True,
                   format: str | None = None) -> IndexedDataset:
    """Concatenate datasets (either format) in the given order into OUTPUT_PREFIX (documents keep their
    order), written in `format` (None: the first input's)."""
    if not prefixes:
        raise IndexedDatasetError("data merge: give at least one input prefix")
    first = IndexedDataset(prefixes[0])
    if first.vocab_size is None and format == "meshtron":
        raise IndexedDatasetError(f"--format: {prefixes[0]} records no vocabulary size (Megatron's format without a "
                                  "sidecar), which meshtron's format needs; merge in Megatron's format, or first run "
                                  f"`meshtron data convert --input {prefixes[0]} --output NEW --format megatron --vocab-size N`")
    writer = IndexedDatasetWriter(output_prefix, first.vocab_size, format or first.format, dtype=first.dtype)
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
