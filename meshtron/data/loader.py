"""Sampling and batching: a seeded shuffled order over epochs, sharded over data-parallel ranks.

The loader's whole state is `consumed_samples` (global), saved in every checkpoint, so a resumed
run continues with exactly the next samples — also when the number of data-parallel ranks changes.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from meshtron.data.samples import collate


class SampleDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, np.ndarray]: ...


class ShuffledOrder:
    """Global sample position g -> dataset index: a fresh seeded permutation for every epoch."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        if num_samples <= 0:
            raise ValueError("the dataset has no samples: add data or lower data.seq_length")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self._epoch, self._perm = -1, np.arange(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                          if self.shuffle else np.arange(self.num_samples))
        return self._perm

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return np.array([self._permutation(int(g) // self.num_samples)[int(g) % self.num_samples]
                         for g in positions], dtype=np.int64)


class BatchLoader:
    """Yields global batches as lists of micro-batches (dicts of (micro_batch, seq) tensors).

    Each global batch covers positions [consumed, consumed + global_batch_size); data-parallel rank r
    takes the r-th contiguous block of global_batch_size / dp_size of them.
    """

    def __init__(self, dataset: SampleDataset, *, micro_batch_size: int, global_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1, shuffle: bool = True, consumed_samples: int = 0):
        assert global_batch_size % (micro_batch_size * dp_size) == 0
        self.dataset, self.order = dataset, ShuffledOrder(len(dataset), seed, shuffle)
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def next_global_batch(self) -> list[dict[str, torch.Tensor]]:
        local = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * local
        indices = self.order(np.arange(start, start + local))
        self.consumed_samples += self.global_batch_size
        mbs = self.micro_batch_size
        return [collate([self.dataset[int(i)] for i in indices[k:k + mbs]]) for k in range(0, local, mbs)]

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])


def fixed_batches(dataset: SampleDataset, micro_batch_size: int, count: int) -> list[dict[str, torch.Tensor]]:
    """The first `count` micro-batches of a dataset in order (evaluation uses the same ones every time)."""
    n = min(len(dataset), micro_batch_size * count)
    return [collate([dataset[i] for i in range(k, min(k + micro_batch_size, n))]) for k in range(0, n, micro_batch_size)]
