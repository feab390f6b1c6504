"""Fill-in-the-middle (FIM): rearrange documents so a left-to-right model learns to infill.

A document (the tokens between eod tokens of a sample) is cut at two random points into
prefix / middle / suffix and, with probability fim_rate, rewritten as
    PSM: <prefix> prefix <suffix> suffix <middle> middle
    SPM: <prefix> <suffix> suffix <middle> prefix middle      (with probability fim_spm_rate)
The three sentinels would lengthen the document, so the end of the suffix is cut by as many tokens:
every document keeps its length and position, and the sample keeps seq_length + 1 tokens (no padding
is ever inserted; `pad_id` only names the token for callers that pad). With
`fim_split_sample`, a chosen document is first split into fragments on that token and each
fragment is rearranged with probability fim_fragment_rate (e.g. one fragment per file of a repo).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshtron.data.gpt_dataset import GPTDataset

NUM_SENTINELS = 3


@dataclass(frozen=True)
class FIMSpec:
    prefix_id: int
    middle_id: int
    suffix_id: int
    pad_id: int
    eod_id: int
    rate: float
    spm_rate: float = 0.5
    split_id: int | None = None
    fragment_rate: float = 0.5
    no_prefix_ids: tuple[int, ...] = ()


def permute(doc: np.ndarray, rng: np.random.Generator, rate: float, spec: FIMSpec) -> np.ndarray:
    """One document (or fragment) rearranged with probability `rate`; same length as `doc`."""
    if not rng.binomial(1, rate):
        return doc
    lo, hi = np.sort(rng.integers(0, len(doc) + 1, size=2))
    prefix, middle, suffix = doc[:lo], doc[lo:hi], doc[hi:]
    if len(suffix) < NUM_SENTINELS or _starts_with(doc, spec.no_prefix_ids):
        return doc  # too short to make room for the sentinels, or excluded
    suffix = suffix[:len(suffix) - NUM_SENTINELS]
    p, m, s = (np.array([t], dtype=doc.dtype) for t in (spec.prefix_id, spec.middle_id, spec.suffix_id))
    if rng.binomial(1, spec.spm_rate):
        out = np.concatenate([p, s, suffix, m, prefix, middle])
    else:
        out = np.concatenate([p, prefix, s, suffix, m, middle])
    assert len(out) == len(doc)
    return out


def _starts_with(doc: np.ndarray, ids: tuple[int, ...]) -> bool:
    return bool(ids) and len(doc) >= len(ids) and tuple(int(t) for t in doc[:len(ids)]) == ids


def _split_and_permute(doc: np.ndarray, rng: np.random.Generator, spec: FIMSpec) -> np.ndarray:
    if spec.split_id is None or not np.any(doc == spec.split_id):
        return permute(doc, rng, spec.rate, spec)
    if not rng.binomial(1, spec.rate):
        return doc
    # Fragments between split tokens are rearranged independently; split tokens stay in place.
    out = doc.copy()
    bounds = np.concatenate([[-1], np.flatnonzero(doc == spec.split_id), [len(doc)]])
    for a, b in zip(bounds[:-1] + 1, bounds[1:]):
        if b > a:
            out[a:b] = permute(doc[a:b], rng, spec.fragment_rate, spec)
    return out


def apply_fim(window: np.ndarray, rng: np.random.Generator, spec: FIMSpec) -> np.ndarray:
    """Each eod-delimited document of `window` goes through FIM; eod tokens and the length are kept."""
    window = np.asarray(window)
    out = window.copy()
    bounds = np.concatenate([[-1], np.flatnonzero(window == spec.eod_id), [len(window)]])
    for a, b in zip(bounds[:-1] + 1, bounds[1:]):
        if b > a:
            out[a:b] = _split_and_permute(window[a:b], rng, spec)
    return out


class GPTFIMDataset:
    """A GPTDataset whose sample windows go through FIM (seeded per sample, so order-independent)."""

    def __init__(self, base: GPTDataset, spec: FIMSpec, seed: int):
        self.base, self.spec, self.seed = base, spec, seed
        self.description = {**base.description, "fim": [spec.rate, spec.spm_rate, spec.fragment_rate, seed]}
        self.indexed = base.indexed

    def __len__(self) -> int:
        return len(self.base)

    def window(self, i: int) -> np.ndarray:
        return apply_fim(self.base.window(i), np.random.default_rng([self.seed, i]), self.spec)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        # FIM keeps every document's length by cutting the suffix, so it adds no padding: the loss mask is
        # the base sample's (real padding only). Masking labels equal to the pad id here would also drop
        # every eod label when pad and eod share an id (tokenizer.allow_ambiguous_pad_tokens).
        return self.base.to_sample(self.window(i))
