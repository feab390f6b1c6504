"""Cache of dataset index arrays, stored next to the data under a hash of the parameters that made them.

The description (a JSON-able dict of every input that determines the arrays) is hashed into the
file names; arrays are written to temporary names and renamed, then the description is written last,
so a cache entry is either complete or absent — concurrent builders (several ranks) cannot corrupt it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


def description_hash(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:20]


def cache_dir_for(prefix: str, cache_dir: str | None) -> Path:
    """`cache_dir` when given, else a `cache` directory beside the dataset files."""
    return Path(cache_dir) if cache_dir else Path(prefix).resolve().parent / "cache"


class IndexCache:
    """Loads (memory-mapped) or builds-and-saves a named group of arrays for one description."""

    def __init__(self, directory: str | Path, kind: str, description: dict):
        self.directory, self.kind, self.description = Path(directory), kind, description
        self.key = description_hash(description)
        self.loaded_from_cache = False

    def path(self, name: str) -> Path:
        return self.directory / f"{self.kind}-{self.key}-{name}.npy"

    @property
    def description_path(self) -> Path:
        return self.directory / f"{self.kind}-{self.key}-description.json"

    def _complete(self, names: list[str]) -> bool:
        if not self.description_path.is_file() or not all(self.path(n).is_file() for n in names):
            return False
        return json.loads(self.description_path.read_text()) == json.loads(json.dumps(self.description))

    def get(self, names: list[str], build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        if self._complete(names):
            self.loaded_from_cache = True
            return {n: np.load(self.path(n), mmap_mode="r") for n in names}
        arrays = build()
        assert set(arrays) == set(names), (sorted(arrays), names)
        self.directory.mkdir(parents=True, exist_ok=True)
        suffix = f".{os.getpid()}.partial.npy"
        for name, array in arrays.items():
            tmp = self.path(name).with_name(self.path(name).name + suffix)
            np.save(tmp, array)
            os.replace(tmp, self.path(name))
        tmp = self.description_path.with_name(self.description_path.name + f".{os.getpid()}.partial")
        tmp.write_text(json.dumps(self.description, indent=1, sort_keys=True))
        os.replace(tmp, self.description_path)
        return arrays
