"""Packing whole documents into fixed-length samples with best fit, keeping documents apart.

`BestFitPacker` places each item into the open bin with the least free space that still holds it
(lowest bin id on ties), opening a new bin when none does; fed longest-first it is best-fit
decreasing. It works on lengths only, so SFT and RL reuse it for variable-length examples.

`PackedDataset` cuts each document into pieces of at most seq_length + 1 tokens (a piece of n
tokens gives n - 1 input/label positions), packs the pieces into samples of seq_length positions,
and pads the rest. Every sample carries document_ids and restarted position_ids, so the model's
context never lets attention cross from one piece into another; padding never reaches the loss.
"""

from __future__ import annotations

import bisect
import heapq
from pathlib import Path

import numpy as np

from meshtron.data.index_cache import IndexCache, cache_dir_for
from meshtron.data.indexed import IndexedDataset

INDEX_VERSION = 1


class BestFitPacker:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"packing capacity {capacity} must be >= 1")
        self.capacity = capacity
        self.bins: list[list[int]] = []
        self.free: list[int] = []
        self._by_free: dict[int, list[int]] = {}   # free space -> heap of bin ids with that space
        self._free_values: list[int] = []           # sorted distinct free spaces that have open bins

    def _push(self, bin_id: int) -> None:
        space = self.free[bin_id]
        if space == 0:
            return  # full bins never take another item
        heap = self._by_free.setdefault(space, [])
        if not heap:
            bisect.insort(self._free_values, space)
        heapq.heappush(heap, bin_id)

    def add(self, item: int, length: int) -> int:
        """Place `item` of `length` units; returns its bin id."""
        if not 0 < length <= self.capacity:
            raise ValueError(f"item {item} has length {length}; it must be in [1, {self.capacity}]")
        k = bisect.bisect_left(self._free_values, length)
        if k == len(self._free_values):
            bin_id = len(self.bins)
            self.bins.append([])
            self.free.append(self.capacity)
        else:
            space = self._free_values[k]
            bin_id = heapq.heappop(self._by_free[space])
            if not self._by_free[space]:
                self._free_values.pop(k)
        self.bins[bin_id].append(item)
        self.free[bin_id] -= length
        self._push(bin_id)
        return bin_id


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of item indices; items are placed longest first (ties in index order)."""
    packer = BestFitPacker(capacity)
    for i in np.argsort(-np.asarray(lengths), kind="stable"):
        packer.add(int(i), int(lengths[i]))
    return packer.bins


def document_pieces(sizes: np.ndarray, doc_range: tuple[int, int], seq_length: int) -> np.ndarray:
    """(num_pieces, 3) rows (doc id, offset, length): documents cut into pieces of <= seq_length + 1
    tokens, consecutive pieces sharing one token so every token but a document's first is a label once."""
    docs = np.arange(*doc_range, dtype=np.int64)
    lengths = np.asarray(sizes, dtype=np.int64)[docs]
    # A document of n >= 2 tokens has n - 1 labels, cut into ceil((n - 1) / L) pieces.
    num_pieces = np.where(lengths >= 2, -(-(lengths - 1) // seq_length), 0)
    doc_of = np.repeat(docs, num_pieces)
    first = np.repeat(np.cumsum(num_pieces) - num_pieces, num_pieces)
    k = np.arange(len(doc_of), dtype=np.int64) - first
    offsets = k * seq_length
    piece_len = np.minimum(seq_length + 1, np.repeat(lengths, num_pieces) - offsets)
    return np.stack([doc_of, offsets, piece_len], axis=1)


class PackedDataset:
    """Samples of whole documents (or pieces of long ones) packed best-fit into seq_length positions."""

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], *, seq_length: int, pad_id: int,
                 cache_dir: str | None = None, name: str = "train", transform=None, seed: int = 0):
        self.indexed, self.seq_length, self.pad_id = indexed, seq_length, pad_id
        self.transform, self.seed = transform, seed   # transform(tokens, rng) -> tokens of the same length
        self.description = {
            "class": "PackedDataset", "version": INDEX_VERSION, "name": name, "prefix": Path(indexed.prefix).name,
            "num_docs": indexed.num_docs, "num_tokens": indexed.num_tokens, "crc": indexed.crc,
            "doc_range": list(doc_range), "seq_length": seq_length,
        }
        cache = IndexCache(cache_dir_for(indexed.prefix, cache_dir), f"packed-{name}", self.description)
        arrays = cache.get(["pieces", "bin_offsets", "bin_pieces"], lambda: self._build(doc_range))
        self.pieces, self.bin_offsets, self.bin_pieces = arrays["pieces"], arrays["bin_offsets"], arrays["bin_pieces"]
        self.cache = cache

    def _build(self, doc_range: tuple[int, int]) -> dict[str, np.ndarray]:
        pieces = document_pieces(self.indexed.sizes, doc_range, self.seq_length)
        bins = best_fit_decreasing(pieces[:, 2] - 1, self.seq_length)
        bin_offsets = np.zeros(len(bins) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in bins], out=bin_offsets[1:])
        bin_pieces = np.array([i for b in bins for i in sorted(b)], dtype=np.int64)
        return {"pieces": pieces, "bin_offsets": bin_offsets, "bin_pieces": bin_pieces}

    def __len__(self) -> int:
        return len(self.bin_offsets) - 1

    def piece_ids(self, i: int) -> np.ndarray:
        return self.bin_pieces[self.bin_offsets[i]:self.bin_offsets[i + 1]]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        rng = np.random.default_rng([self.seed, i]) if self.transform is not None else None
        pieces = []
        for p in self.piece_ids(i):
            doc, offset, length = (int(x) for x in self.pieces[p])
            tokens = np.asarray(self.indexed.get(doc, offset, length), dtype=np.int64)
            if self.transform is not None:
                tokens = self.transform(tokens, rng)
            pieces.append((tokens, np.ones(length - 1, dtype=np.float32)))
        return assemble_sample(pieces, self.seq_length, self.pad_id)


def assemble_sample(pieces: list[tuple[np.ndarray, np.ndarray]], seq_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """One packed sample from pieces (tokens (n + 1,), label loss mask (n,)), each a document of its own:
    n input/label positions with positions restarting at 0, then padding (its own document, no loss)."""
    L = seq_length
    input_ids = np.full(L, pad_id, dtype=np.int64)
    labels = np.full(L, pad_id, dtype=np.int64)
    loss_mask = np.zeros(L, dtype=np.float32)
    document_ids = np.full(L, len(pieces), dtype=np.int64)   # padding is one more "document" of its own
    position_ids = np.arange(L, dtype=np.int64)
    at = 0
    for k, (tokens, mask) in enumerate(pieces):
        n = len(tokens) - 1
        assert at + n <= L and len(mask) == n
        input_ids[at:at + n], labels[at:at + n] = tokens[:-1], tokens[1:]
        loss_mask[at:at + n] = mask
        document_ids[at:at + n] = k
        position_ids[at:at + n] = np.arange(n)
        at += n
    position_ids[at:] = np.arange(L - at)
    return {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask,
            "document_ids": document_ids, "position_ids": position_ids}
