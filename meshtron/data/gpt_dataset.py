"""GPTDataset: fixed-length training samples cut from a stream of documents over one or more epochs.

Three indices, all vectorised numpy and cached next to the data (see index_cache.py):
  document index  the split's document ids, repeated once per epoch and shuffled (seeded);
  sample index    (num_samples + 1, 2): for sample j, where global token j * seq_length lies, as
                  (position in the document index, offset in that document); with the extra token
                  (the default) sample j covers global tokens [j * seq_length, (j + 1) * seq_length],
                  seq_length + 1 tokens, so that input and label both have seq_length and every token
                  is a label once; without it, seq_length tokens and the last label is masked;
  shuffle index   a seeded permutation of the samples.
When the last epoch is only partly used, it is shuffled on its own (as Megatron does), so the
samples of the earlier full epochs are not diluted by a fraction of an epoch.

Two orders (`sample_order`): "megatron" draws the document and shuffle indices exactly as
megatron-core's GPTDataset does (megatron_order.py), "meshtron" is meshtron's earlier order
(numpy's PCG64 generator). Both share the sample index and the samples' contents given the indices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshtron.data import megatron_order
from meshtron.data.index_cache import IndexCache, cache_dir_for
from meshtron.data.indexed import IndexedDataset
from meshtron.data.samples import make_sample

INDEX_VERSION = 2
SEPARATE_LAST_EPOCH_BELOW = 0.8   # fraction of an epoch under which the last epoch is shuffled apart
MAX_DOCUMENT_INDEX = 1 << 31      # entries of the document index (epochs x documents): 16 GiB of int64
SAMPLE_ORDERS = ("megatron", "meshtron")


def split_document_ranges(num_docs: int, weights: list[float]) -> list[tuple[int, int]]:
    """Consecutive document ranges [start, end) for train/valid/test, sized by the split weights
    (the bounds Megatron computes: round(cumulative weight * num_docs), ties to even)."""
    bounds = np.round(np.cumsum([0.0] + list(weights)) * num_docs).astype(np.int64)
    bounds[-1] = num_docs
    return [(int(bounds[k]), int(bounds[k + 1])) for k in range(len(weights))]


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int | None, extra: int = 1) -> int:
    """The fewest epochs whose token stream yields `num_samples` samples (1 when not asked)."""
    return megatron_order.num_epochs(tokens_per_epoch, seq_length, num_samples, extra)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.Generator,
                         separate_last_epoch: bool) -> np.ndarray:
    if separate_last_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate([first, last])
    doc_idx = np.tile(documents.astype(np.int64), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_index(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int,
                       extra: int = 1) -> np.ndarray:
    """(num_samples + 1, 2) int64 rows (position in doc_idx, token offset) of global tokens j * seq_length.
    Row j + 1 is where sample j ends: with the extra token, the document holding that (shared) token;
    without it, the first document that ends at or after it (the offset may equal its size), which is
    how Megatron's loop records it. Row 0 is (0, 0)."""
    if num_samples == 0:
        return np.zeros((1, 2), dtype=np.int64)
    lengths = np.asarray(sizes, dtype=np.int64)[doc_idx]
    ends = np.cumsum(lengths)                       # ends[p]: global position just past document p
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    assert starts[-1] + extra <= ends[-1]
    pos = np.searchsorted(ends, starts, side="right" if extra else "left")
    offsets = starts - (ends[pos] - lengths[pos])
    rows = np.stack([pos, offsets], axis=1).astype(np.int64)
    rows[0] = 0
    return rows


def build_shuffle_index(num_samples: int, num_first: int, rng: np.random.Generator) -> np.ndarray:
    """Permutation of [0, num_first) followed by a permutation of [num_first, num_samples)."""
    first = rng.permutation(num_first).astype(np.int64)
    last = num_first + rng.permutation(num_samples - num_first).astype(np.int64)
    return np.concatenate([first, last])


class GPTDataset:
    """Samples of seq_length (+ 1 with the extra token) tokens over documents [doc_start, doc_end) of an
    indexed dataset, in Megatron's or meshtron's order."""

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], *, seq_length: int, seed: int,
                 eod_id: int, pad_id: int | None = None, num_samples: int | None = None,
                 cache_dir: str | None = None, name: str = "train",
                 reset_attention_mask: bool = False, reset_position_ids: bool = False,
                 sample_order: str = "megatron", add_extra_token: bool = True):
        assert sample_order in SAMPLE_ORDERS, sample_order
        self.indexed, self.doc_range, self.seq_length, self.seed = indexed, doc_range, seq_length, seed
        self.eod_id, self.pad_id = eod_id, pad_id
        self.reset_attention_mask, self.reset_position_ids = reset_attention_mask, reset_position_ids
        self.sample_order, self.extra = sample_order, int(add_extra_token)
        start, end = doc_range
        self.tokens_per_epoch = int(indexed.offsets[end] - indexed.offsets[start])
        self.num_epochs = num_epochs_for(self.tokens_per_epoch, seq_length, num_samples, self.extra)
        if self.num_epochs * (end - start) > MAX_DOCUMENT_INDEX:
            raise ValueError(f"data.paths: {indexed.prefix} ({name}: {self.tokens_per_epoch} tokens) would be repeated "
                             f"{self.num_epochs} times for {num_samples} samples; add data or train for fewer steps")
        self.description = {
            "class": "GPTDataset", "version": INDEX_VERSION, "name": name, "prefix": Path(indexed.prefix).name,
            "format": indexed.format, "num_docs": indexed.num_docs, "num_tokens": indexed.num_tokens,
            "crc": indexed.crc, "doc_range": list(doc_range), "seq_length": seq_length, "seed": seed,
            "num_samples": num_samples, "sample_order": sample_order, "extra": self.extra,
        }
        self.cache = IndexCache(cache_dir_for(indexed.prefix, cache_dir), f"gpt-{name}", self.description)
        build = self._build_megatron if sample_order == "megatron" else self._build_meshtron
        arrays = self.cache.get(["doc_idx", "sample_idx", "shuffle_idx"], lambda: build(num_samples))
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays["doc_idx"], arrays["sample_idx"], arrays["shuffle_idx"]

    def _build_meshtron(self, num_samples: int | None) -> dict[str, np.ndarray]:
        L, T, E, extra = self.seq_length, self.tokens_per_epoch, self.num_epochs, self.extra
        total = megatron_order.num_samples_of(E * T, L, extra)
        num_first = total
        separate = False
        if num_samples is not None and E > 1:
            num_first = megatron_order.num_samples_of((E - 1) * T, L, extra)
            per_epoch = max(1, megatron_order.num_samples_of(T, L, extra))
            separate = (num_samples - num_first) < SEPARATE_LAST_EPOCH_BELOW * per_epoch
        rng = np.random.default_rng(self.seed)
        documents = np.arange(*self.doc_range, dtype=np.int64)
        doc_idx = build_document_index(documents, E, rng, separate)
        sample_idx = build_sample_index(self.indexed.sizes, doc_idx, L, total, extra)
        shuffle_idx = build_shuffle_index(total, num_first if separate else total, rng)
        return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

    def _build_megatron(self, num_samples: int | None) -> dict[str, np.ndarray]:
        """Megatron's draws, in Megatron's sequence: the document index, then the shuffle index."""
        mo, L, T, E, extra = megatron_order, self.seq_length, self.tokens_per_epoch, self.num_epochs, self.extra
        separate, before = mo.separate_final_epoch(T, L, num_samples, E, extra)
        rng = np.random.RandomState(self.seed)
        doc_idx = mo.build_document_index(np.arange(*self.doc_range), E, rng, separate)
        total = mo.num_samples_of(E * T, L, extra)
        sample_idx = build_sample_index(self.indexed.sizes, doc_idx, L, total, extra)
        shuffle_idx = mo.build_shuffle_index(before if separate else total, total, rng)
        return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def window(self, i: int) -> np.ndarray:
        """The seq_length + extra tokens of sample i (after shuffling)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        j = int(self.shuffle_idx[i])
        (p0, o0), (p1, o1) = self.sample_idx[j], self.sample_idx[j + 1]
        p0, o0, p1, o1 = int(p0), int(o0), int(p1), int(o1)
        if p0 == p1:
            return np.asarray(self.indexed.get(int(self.doc_idx[p0]), o0, o1 - o0 + self.extra))
        parts = [self.indexed.get(int(self.doc_idx[p0]), o0)]
        parts += [self.indexed[int(self.doc_idx[p])] for p in range(p0 + 1, p1)]
        parts.append(self.indexed.get(int(self.doc_idx[p1]), 0, o1 + self.extra))
        return np.concatenate(parts)

    def to_sample(self, window: np.ndarray) -> dict[str, np.ndarray]:
        if self.extra:
            return make_sample(window, self.eod_id, self.pad_id, reset_attention_mask=self.reset_attention_mask,
                               reset_position_ids=self.reset_position_ids)
        # Without the extra token the last input has no next token: its label is a filler, masked.
        filler = self.pad_id if self.pad_id is not None else self.eod_id
        sample = make_sample(np.append(window, filler), self.eod_id, self.pad_id,
                             reset_attention_mask=self.reset_attention_mask, reset_position_ids=self.reset_position_ids)
        sample["loss_mask"][-1] = 0.0
        return sample

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.to_sample(self.window(i))
