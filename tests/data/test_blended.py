"""BlendedDataset: per-dataset counts within one sample of the weights, an interleave equal to a
slow exact-fraction merge, identical across builds, and samples taken from the right dataset."""

from __future__ import annotations

import heapq
from fractions import Fraction

import numpy as np
import pytest
from data_helpers import random_docs, write_indexed

from meshtron.data.blended import BlendedDataset, blend_counts, build_blend_indices
from meshtron.data.gpt_dataset import GPTDataset


def reference_blend(weights, size):
    """Counts by largest remainder with exact fractions, then merge by due time (2k+1)/(2c), ties by dataset."""
    total = sum(Fraction(w).limit_denominator(10**9) for w in weights)
    exact = [Fraction(w).limit_denominator(10**9) / total * size for w in weights]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda d: (-(exact[d] - counts[d]), d))
    for d in by_remainder[:size - sum(counts)]:
        counts[d] += 1
    heap = [(Fraction(1, 2 * c), d, 0) for d, c in enumerate(counts) if c > 0]
    heapq.heapify(heap)
    dataset, sample = [], []
    while heap:
        _, d, k = heapq.heappop(heap)
        dataset.append(d)
        sample.append(k)
        if k + 1 < counts[d]:
            heapq.heappush(heap, (Fraction(2 * k + 3, 2 * counts[d]), d, k + 1))
    return counts, dataset, sample


@pytest.mark.parametrize("weights,size", [([0.7, 0.3], 100), ([1, 1, 1], 10), ([0.5, 0.25, 0.125, 0.125], 333),
                                          ([0.9, 0.0, 0.1], 57), ([3, 2, 5, 7, 11], 1000), ([1.0], 5)])
def test_indices_match_reference(weights, size):
    counts, dataset, sample = reference_blend(weights, size)
    assert blend_counts(weights, size).tolist() == counts
    got_dataset, got_sample = build_blend_indices(weights, size)
    assert got_dataset.tolist() == dataset and got_sample.tolist() == sample


def test_counts_and_prefixes_follow_the_weights():
    rng = np.random.default_rng(0)
    for _ in range(50):
        weights = rng.random(int(rng.integers(1, 6))) + 0.01
        size = int(rng.integers(1, 3000))
        w = weights / weights.sum()
        counts = blend_counts(weights.tolist(), size)
        assert counts.sum() == size and np.all(np.abs(counts - w * size) < 1)
        dataset, _ = build_blend_indices(weights.tolist(), size)
        seen = np.zeros((size, len(w)))
        seen[np.arange(size), dataset] = 1
        prefix_counts = np.cumsum(seen, axis=0)
        expected = np.arange(1, size + 1)[:, None] * w[None, :]
        # Due-time merge: |count_d(m) - w_d m| < 3/2 + w_d * num_datasets / 2 for every prefix m.
        assert np.all(np.abs(prefix_counts - expected) < 1.5 + w * len(w) / 2)


def test_blended_dataset_samples_and_cache(tmp_path):
    rng = np.random.default_rng(2)
    parts = []
    for k in range(2):
        indexed = write_indexed(tmp_path / f"d{k}", random_docs(rng, 20, 30, vocab_size=500), vocab_size=1000)
        parts.append(GPTDataset(indexed, (0, 20), seq_length=8, seed=1, eod_id=999, cache_dir=str(tmp_path / "c")))
    blend = BlendedDataset(parts, [0.7, 0.3], 100, cache_dir=str(tmp_path / "c"))
    again = BlendedDataset(parts, [0.7, 0.3], 100, cache_dir=str(tmp_path / "c"))
    other = BlendedDataset(parts, [0.7, 0.3], 100, cache_dir=str(tmp_path / "c2"))
    assert again.cache.loaded_from_cache and not other.cache.loaded_from_cache
    assert np.array_equal(blend.dataset_index, other.dataset_index)
    assert np.array_equal(blend.dataset_sample_index, other.dataset_sample_index)
    assert np.bincount(blend.dataset_index).tolist() == [70, 30]
    for i in range(len(blend)):
        d, k = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        assert blend[i]["input_ids"].tolist() == parts[d][k % len(parts[d])]["input_ids"].tolist()
    with pytest.raises(IndexError):
        blend[100]


def test_empty_dataset_with_weight_is_refused(tmp_path):
    indexed = write_indexed(tmp_path / "d", [[1, 2, 3]] * 10)
    full = GPTDataset(indexed, (0, 10), seq_length=4, seed=0, eod_id=999, cache_dir=str(tmp_path / "c"))
    empty = GPTDataset(indexed, (5, 5), seq_length=4, seed=0, eod_id=999, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="no train samples"):
        BlendedDataset([full, empty], [0.5, 0.5], 10, cache_dir=str(tmp_path / "c"))
