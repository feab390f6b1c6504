"""Turning a window of seq_length + 1 tokens into a training sample, and batching samples.

A sample holds input_ids and labels (shifted by one), a loss mask, and — when documents are
packed and must not see each other — document ids and restarted positions for the model context.
"""

from __future__ import annotations

import numpy as np
import torch


def make_sample(window: np.ndarray, eod_id: int, pad_id: int | None = None, *,
                reset_attention_mask: bool = False, reset_position_ids: bool = False) -> dict[str, np.ndarray]:
    """window (seq + 1,) token ids -> dict of (seq,) arrays."""
    window = window.astype(np.int64)
    tokens, labels = window[:-1], window[1:]
    loss_mask = np.ones(len(tokens), dtype=np.float32)
    if pad_id is not None and pad_id != eod_id:
        loss_mask[labels == pad_id] = 0.0
    sample = {"input_ids": tokens, "labels": labels, "loss_mask": loss_mask}
    if reset_attention_mask or reset_position_ids:
        # A new document starts after each eod token; the eod itself ends the previous document.
        starts = np.zeros(len(tokens), dtype=np.int64)
        starts[1:] = tokens[:-1] == eod_id
        doc_ids = np.cumsum(starts)
        if reset_attention_mask:
            sample["document_ids"] = doc_ids
        if reset_position_ids:
            first = np.flatnonzero(np.r_[1, starts[1:]])  # index where each document begins
            sample["position_ids"] = np.arange(len(tokens)) - first[doc_ids]
    return sample


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack per-sample arrays into (batch, seq) tensors."""
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}
