"""Token-level cross-entropy with a loss mask, returned as (sum of losses, number of tokens)
so that micro-batches and ranks can be normalised by the global token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                         loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (batch, seq, vocab), labels (batch, seq), loss_mask (batch, seq) of 0/1."""
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    if loss_mask is None:
        return losses.sum(), torch.tensor(labels.numel(), device=labels.device)
    mask = loss_mask.flatten().to(losses.dtype)
    return (losses * mask).sum(), mask.sum()
