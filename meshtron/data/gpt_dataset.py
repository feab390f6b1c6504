"""GPTDataset: fixed-length training samples cut from a stream of documents over one or more epochs.

Three indices, all vectorised numpy and cached next to the data (see index_cache.py):
  document index  the split's document ids, repeated once per epoch and shuffled (seeded);
  sample index    (num_samples + 1, 2): for sample j, where global token j * seq_length lies, as
                  (position in the document index, offset in that document); sample j covers global
                  tokens [j * seq_length, (j + 1) * seq_length] — seq_length + 1 tokens, so that
                  input and label both have seq_length and every token is a label once;
  shuffle index   a seeded permutation of the samples.
When the last epoch is only partly used, it is shuffled on its own (as Megatron does), so the
samples of the earlier full epochs are not diluted by a fraction of an epoch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshtron.data.index_cache import IndexCache, cache_dir_for
from meshtron.data.indexed import IndexedDataset
from meshtron.data.samples import make_sample

INDEX_VERSION = 1
SEPARATE_LAST_EPOCH_BELOW = 0.8   # fraction of an epoch under which the last epoch is shuffled apart
MAX_DOCUMENT_INDEX = 1 << 31      # entries of the document index (epochs x documents): 16 GiB of int64


def split_document_ranges(num_docs: int, weights: list[float]) -> list[tuple[int, int]]:
    """Consecutive document ranges [start, end) for train/valid/test, sized by the split weights."""
    bounds = np.round(np.cumsum([0.0] + list(weights)) * num_docs).astype(np.int64)
    bounds[-1] = num_docs
    return [(int(bounds[k]), int(bounds[k + 1])) for k in range(len(weights))]


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """The fewest epochs whose token stream yields `num_samples` samples (1 when not asked)."""
    if num_samples is None or tokens_per_epoch == 0:
        return 1
    # Samples from E epochs: (E * T - 1) // L >= n  <=>  E * T >= n * L + 1.
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.Generator,
                         separate_last_epoch: bool) -> np.ndarray:
    if separate_last_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate([first, last])
    doc_idx = np.tile(documents.astype(np.int64), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_index(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """(num_samples + 1, 2) int64 rows (position in doc_idx, token offset) of global tokens j * seq_length."""
    if num_samples == 0:
        return np.zeros((1, 2), dtype=np.int64)
    lengths = np.asarray(sizes, dtype=np.int64)[doc_idx]
    ends = np.cumsum(lengths)                       # ends[p]: global position just past document p
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    assert starts[-1] < ends[-1]
    pos = np.searchsorted(ends, starts, side="right")   # first document ending after the token (skips empty ones)
    offsets = starts - (ends[pos] - lengths[pos])
    return np.stack([pos, offsets], axis=1).astype(np.int64)


def build_shuffle_index(num_samples: int, num_first: int, rng: np.random.Generator) -> np.ndarray:
    """Permutation of [0, num_first) followed by a permutation of [num_first, num_samples)."""
    first = rng.permutation(num_first).astype(np.int64)
    last = num_first + rng.permutation(num_samples - num_first).astype(np.int64)
    return np.concatenate([first, last])


class GPTDataset:
    """Samples of seq_length + 1 tokens over documents [doc_start, doc_end) of an indexed dataset."""

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], *, seq_length: int, seed: int,
                 eod_id: int, pad_id: int | None = None, num_samples: int | None = None,
                 cache_dir: str | None = None, name: str = "train",
                 reset_attention_mask: bool = False, reset_position_ids: bool = False):
        self.indexed, self.doc_range, self.seq_length, self.seed = indexed, doc_range, seq_length, seed
        self.eod_id, self.pad_id = eod_id, pad_id
        self.reset_attention_mask, self.reset_position_ids = reset_attention_mask, reset_position_ids
        start, end = doc_range
        self.tokens_per_epoch = int(indexed.offsets[end] - indexed.offsets[start])
        self.num_epochs = num_epochs_for(self.tokens_per_epoch, seq_length, num_samples)
        if self.num_epochs * (end - start) > MAX_DOCUMENT_INDEX:
            raise ValueError(f"data.paths: {indexed.prefix} ({name}: {self.tokens_per_epoch} tokens) would be repeated "
                             f"{self.num_epochs} times for {num_samples} samples; add data or train for fewer steps")
        self.description = {
            "class": "GPTDataset", "version": INDEX_VERSION, "name": name, "prefix": Path(indexed.prefix).name,
            "num_docs": indexed.num_docs, "num_tokens": indexed.num_tokens, "crc": indexed.crc,
            "doc_range": list(doc_range), "seq_length": seq_length, "seed": seed, "num_samples": num_samples,
        }
        self.cache = IndexCache(cache_dir_for(indexed.prefix, cache_dir), f"gpt-{name}", self.description)
        arrays = self.cache.get(["doc_idx", "sample_idx", "shuffle_idx"], lambda: self._build(num_samples))
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]

    def _build(self, num_samples: int | None) -> dict[str, np.ndarray]:
        L, T, E = self.seq_length, self.tokens_per_epoch, self.num_epochs
        total = max(0, (E * T - 1) // L)
        num_first = total
        separate = False
        if num_samples is not None and E > 1:
            num_first = max(0, ((E - 1) * T - 1) // L)
            per_epoch = max(1, (T - 1) // L)
            separate = (num_samples - num_first) < SEPARATE_LAST_EPOCH_BELOW * per_epoch
        rng = np.random.default_rng(self.seed)
        documents = np.arange(*self.doc_range, dtype=np.int64)
        doc_idx = build_document_index(documents, E, rng, separate)
        sample_idx = build_sample_index(self.indexed.sizes, doc_idx, L, total)
        shuffle_idx = build_shuffle_index(total, num_first if separate else total, rng)
        return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def window(self, i: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample i (after shuffling)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        j = int(self.shuffle_idx[i])
        (p0, o0), (p1, o1) = self.sample_idx[j], self.sample_idx[j + 1]
        p0, o0, p1, o1 = int(p0), int(o0), int(p1), int(o1)
        if p0 == p1:
            return np.asarray(self.indexed.get(int(self.doc_idx[p0]), o0, o1 - o0 + 1))
        parts = [self.indexed.get(int(self.doc_idx[p0]), o0)]
        parts += [self.indexed[int(self.doc_idx[p])] for p in range(p0 + 1, p1)]
        parts.append(self.indexed.get(int(self.doc_idx[p1]), 0, o1 + 1))
        return np.concatenate(parts)

    def to_sample(self, window: np.ndarray) -> dict[str, np.ndarray]:
        return make_sample(window, self.eod_id, self.pad_id, reset_attention_mask=self.reset_attention_mask,
                           reset_position_ids=self.reset_position_ids)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.to_sample(self.window(i))
