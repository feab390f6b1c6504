"""Vocabulary-parallel cross-entropy: logits stay sharded over the vocabulary (DTensor Shard(-1))
and `loss_parallel` computes log-softmax with an all-reduce of the row max and of the sum of
exponentials across tensor-parallel ranks, so no rank ever holds full-vocabulary logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def vocab_parallel_cross_entropy(logits: DTensor, labels: torch.Tensor,
                                 loss_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `meshtron.nn.loss.masked_cross_entropy` for vocabulary-sharded logits.

    Must run (and its backward too) inside `loss_parallel()`; the trainer wraps the micro-batch.
    """
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    if isinstance(losses, DTensor):
        losses = losses.full_tensor()  # per-token losses are tiny: (batch * seq,)
    if loss_mask is None:
        return losses.sum(), torch.tensor(labels.numel(), device=labels.device)
    mask = loss_mask.flatten().to(losses.dtype)
    return (losses * mask).sum(), mask.sum()


__all__ = ["loss_parallel", "vocab_parallel_cross_entropy"]
