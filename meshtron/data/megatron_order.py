"""Megatron-LM's sample order: the document, sample and shuffle indices built as megatron-core's
GPTDataset builds them, so that a run started in Megatron-LM continues here on the same samples.

What differs from meshtron's own order (gpt_dataset.py): the generator is numpy's legacy
`RandomState(seed)` (Mersenne Twister) drawn in Megatron's sequence (document index, then shuffle
index), the document index is int32, and the final epoch is shuffled apart when it contributes fewer
than int(0.8 * samples per epoch) samples (meshtron compares with 0.8 * samples per epoch, untruncated).
The sample index is the same in both: sample j starts at global token j * seq_length.
"""

from __future__ import annotations

import numpy as np

SEPARATE_FINAL_EPOCH_BELOW = 0.80   # Megatron's threshold, as a fraction of the samples per epoch


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int | None, extra: int) -> int:
    """The fewest epochs whose tokens make `num_samples` samples of seq_length (+ extra) tokens."""
    if num_samples is None or tokens_per_epoch == 0:
        return 1
    needed = num_samples * seq_length + extra
    return max(1, -(-needed // tokens_per_epoch))


def num_samples_of(num_tokens: int, seq_length: int, extra: int) -> int:
    """Whole samples in a stream of num_tokens tokens (the last partial one dropped)."""
    return max(0, (num_tokens - extra) // seq_length)


def separate_final_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int | None, epochs: int,
                         extra: int) -> tuple[bool, int]:
    """(whether the final epoch is shuffled apart, the number of samples before it)."""
    if epochs == 1 or num_samples is None:
        return False, 0
    before = num_samples_of((epochs - 1) * tokens_per_epoch, seq_length, extra)
    from_final = num_samples - before
    per_epoch = num_samples_of(tokens_per_epoch, seq_length, extra)
    assert 0 <= from_final <= per_epoch + 1
    return from_final < int(SEPARATE_FINAL_EPOCH_BELOW * per_epoch), before


def build_document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    """The documents repeated once per epoch, shuffled as one block (or the final epoch apart)."""
    if separate_final and epochs > 1:
        first = build_document_index(documents, epochs - 1, rng, False)
        return np.concatenate([first, build_document_index(documents, 1, rng, False)])
    doc_idx = np.tile(np.asarray(documents, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_shuffle_index(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A shuffled [0, num_first), then (when total > num_first) a shuffled [num_first, total)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])
