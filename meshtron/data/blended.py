"""BlendedDataset: a weighted mixture of datasets with exact per-dataset sample counts.

Counts: dataset d gets floor(w_d * size) samples, and the samples left over go to the largest
remainders, so every count is within one sample of w_d * size and they sum to `size`.
Interleave: the k-th sample of dataset d is due at time (k + 1/2) / count_d; all samples are merged
by due time (ties by dataset order), which spreads each dataset evenly over the whole mixture: any
prefix of m samples holds w_d * m of dataset d to within 3/2 + w_d * num_datasets / 2 samples. Both are deterministic and
cached next to the first dataset's data.
"""

from __future__ import annotations

import numpy as np

from meshtron.data.index_cache import IndexCache, cache_dir_for

INDEX_VERSION = 1


def blend_counts(weights: list[float], size: int) -> np.ndarray:
    """Largest-remainder rounding of w_d * size; sums to size exactly."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    raw = w * size
    counts = np.floor(raw).astype(np.int64)
    leftover = size - int(counts.sum())
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[:leftover]] += 1
    return counts


def build_blend_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index), each (size,): which dataset, and which of its samples."""
    counts = blend_counts(weights, size)
    dataset = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    sample = np.concatenate([np.arange(c, dtype=np.int64) for c in counts]) if size else np.zeros(0, np.int64)
    # Due time (2k + 1) / (2 c): IEEE division rounds correctly, so equal fractions compare equal.
    due = (2 * sample + 1) / (2.0 * counts[dataset]) if size else np.zeros(0)
    order = np.lexsort((dataset, due))
    return dataset[order].astype(np.int16 if len(counts) < 1 << 15 else np.int64), sample[order]


class BlendedDataset:
    """Sample i is sample dataset_sample_index[i] of datasets[dataset_index[i]] (wrapping past its end)."""

    def __init__(self, datasets: list, weights: list[float], size: int, *, cache_dir: str | None = None,
                 name: str = "train"):
        if len(datasets) != len(weights):
            raise ValueError(f"data.paths: {len(datasets)} datasets but {len(weights)} weights")
        self.datasets, self.weights, self.size = datasets, list(weights), size
        empty = [k for k, (ds, w) in enumerate(zip(datasets, weights)) if len(ds) == 0 and w > 0]
        if empty and size > 0:
            names = ", ".join(getattr(datasets[k], "description", {}).get("prefix", str(k)) for k in empty)
            raise ValueError(f"data.paths: dataset(s) {names} have no {name} samples but a positive weight; "
                             "add documents, lower data.seq_length or change data.split")
        description = {"class": "BlendedDataset", "version": INDEX_VERSION, "name": name, "size": size,
                       "weights": self.weights,
                       "datasets": [getattr(ds, "description", {"len": len(ds)}) for ds in datasets]}
        first_prefix = getattr(getattr(datasets[0], "indexed", None), "prefix", ".")
        self.cache = IndexCache(cache_dir_for(first_prefix, cache_dir), f"blend-{name}", description)
        arrays = self.cache.get(["dataset_index", "dataset_sample_index"], self._build)
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        self.description = description

    def _build(self) -> dict[str, np.ndarray]:
        dataset_index, sample_index = build_blend_indices(self.weights, self.size)
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} of {self.size}")
        ds = self.datasets[int(self.dataset_index[i])]
        return ds[int(self.dataset_sample_index[i]) % len(ds)]
