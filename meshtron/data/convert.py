"""`meshtron data convert`: rewrite a prefix in Megatron's or meshtron's format, streaming.

The token payload is copied in chunks of `chunk_bytes` (cast when the target format needs another
dtype, range-checked either way) and the index is written from the source's memory-mapped sizes in
bounded chunks, so memory stays flat however large the dataset is. Meshtron's integrity data (pair id,
vocabulary size, checksum, maximum id) travels with it: in the .idx header of meshtron's format, in the
PREFIX.meshtron.json sidecar of Megatron's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshtron.data.indexed import (
    DTYPE_CODES,
    SCAN_BYTES,
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    check_format,
    dtype_for_vocab,
    iter_token_chunks,
    paths_of,
)


def _target_dtype(src: IndexedDataset, fmt: str, vocab_size: int | None) -> np.dtype:
    if fmt == "megatron" or src.dtype in DTYPE_CODES:
        return src.dtype
    return dtype_for_vocab(vocab_size)   # meshtron's format holds uint16 or int32 only


def _vocab_size(src: IndexedDataset, fmt: str, vocab_size: int | None) -> int | None:
    if vocab_size is not None and vocab_size < 1:
        raise IndexedDatasetError(f"--vocab-size: {vocab_size} is not allowed; must be >= 1")
    if vocab_size is not None and src.vocab_size is not None and vocab_size != src.vocab_size:
        raise IndexedDatasetError(f"--vocab-size: {src.prefix} records vocab_size {src.vocab_size}, not {vocab_size}; "
                                  "leave --vocab-size out")
    vocab = src.vocab_size if vocab_size is None else vocab_size
    if vocab is None and fmt == "meshtron":
        raise IndexedDatasetError(f"--vocab-size: {src.prefix} records no vocabulary size (Megatron's format without "
                                  "a meshtron sidecar); give --vocab-size N or --tokenizer for meshtron's format")
    return vocab


def convert_dataset(input_prefix: str, output_prefix: str, fmt: str, *, vocab_size: int | None = None,
                    chunk_bytes: int = SCAN_BYTES) -> IndexedDataset:
    """Write INPUT_PREFIX's documents to OUTPUT_PREFIX in format `fmt`; returns the new dataset."""
    check_format(fmt)
    if any(a.resolve() == b.resolve() for a, b in zip(paths_of(input_prefix), paths_of(output_prefix))):
        raise IndexedDatasetError(f"--output: {output_prefix} is the input prefix; write to another prefix")
    src = IndexedDataset(input_prefix)
    vocab = _vocab_size(src, fmt, vocab_size)
    writer = IndexedDatasetWriter(output_prefix, vocab, fmt, dtype=_target_dtype(src, fmt, vocab),
                                  pair_id=src.pair_id)
    try:
        for ids in iter_token_chunks(src, chunk_bytes):
            writer.add_payload(ids)
        if src.crc is not None and writer.dtype == src.dtype and writer.crc != src.crc:
            raise IndexedDatasetError(f"{input_prefix}.bin: checksum {writer.crc:#010x} differs from the recorded "
                                      f"{src.crc:#010x} (corrupt); nothing written")
        grouped = src.document_indices if src.grouped and fmt == "megatron" else None
        writer.finalize(sizes=src.sizes, document_indices=grouped)
    except BaseException:
        writer.abort()
        raise
    return IndexedDataset(output_prefix)


def describe(ds: IndexedDataset) -> str:
    side = f" + {Path(ds.prefix).name}.meshtron.json" if ds.format == "megatron" else ""
    return f"{ds.prefix}.bin/.idx{side} ({ds.format}): {ds.num_docs} documents, {ds.num_tokens} tokens ({ds.dtype})"
