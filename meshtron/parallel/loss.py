"""Vocabulary-parallel losses: logits stay sharded over the vocabulary (DTensor Shard(-1)), so no
rank ever holds full-vocabulary logits.

Cross-entropy: `loss_parallel` computes log-softmax with an all-reduce of the row max and of the sum
of exponentials across tensor-parallel ranks.

Log probs and entropy (`vocab_parallel_log_probs`, RL): rank r holds z[..., r V/tp : (r + 1) V/tp].
With m the row max (all-reduce max, no gradient: the result does not depend on it), s = sum_r sum_v
exp(z_v - m) (all-reduce sum), lse = m + log s, the chosen token's logit z_y found on the one rank
that holds y (others add 0, all-reduce sum): log p(y) = z_y - lse; entropy H = lse - sum_v p_v z_v
(all-reduce sum). Every rank computes the same replicated loss, so the sums are "all-reduce forward,
identity backward" (each rank's local logits get the gradient of the one loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshtron.parallel.distributed import reduce_from_group


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


def vocab_parallel_log_probs(logits: DTensor, labels: torch.Tensor, temperature: float = 1.0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy) under softmax(logits / temperature), each (...) and replicated, from
    logits sharded over the vocabulary on a 1-D TP mesh."""
    mesh = logits.device_mesh
    assert mesh.ndim == 1 and logits.placements[0].is_shard(logits.ndim - 1), "logits sharded over the vocabulary"
    local = logits.to_local().float()
    assert logits.shape[-1] % mesh.size() == 0 and local.shape[-1] == logits.shape[-1] // mesh.size()
    group, first = mesh.get_group(), mesh.get_local_rank() * local.shape[-1]
    z = local / temperature
    with torch.no_grad():
        m = z.max(-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    lse = m + reduce_from_group((z - m[..., None]).exp().sum(-1), group).log()
    mine = (labels >= first) & (labels < first + z.shape[-1])
    picked = z.gather(-1, (labels - first).clamp(0, z.shape[-1] - 1)[..., None].long())[..., 0]
    label_logit = reduce_from_group(picked * mine, group)
    p = (z - lse[..., None]).exp()
    expected_z = reduce_from_group((p * z).sum(-1), group)
    return label_logit - lse, lse - expected_z


__all__ = ["loss_parallel", "vocab_parallel_cross_entropy", "vocab_parallel_log_probs"]
