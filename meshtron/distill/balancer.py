"""The loss balancer: the distillation objective as a weighted sum of its terms, with every term
logged on its own.

    total = label_weight * CE(student, labels) + sum_i weight_i * L_i(student, teacher)

Every term is a sum over the loss tokens (the trainer divides the total by the global batch's
number of loss tokens). The extras returned for logging are (sum, count) pairs: `lm_loss` (the
student's cross-entropy, logged even at weight 0), `distill_<name>` (each loss, unweighted) and
`distill_<name>_<key>` for what a loss reports.
"""

from __future__ import annotations

from typing import Optional

import torch

from meshtron.distill.losses import DistillLoss, ModelOutputs


class LossBalancer:
    def __init__(self, losses: dict[str, DistillLoss], weights: dict[str, float], label_weight: float = 0.0):
        assert set(losses) == set(weights)
        self.losses, self.weights, self.label_weight = losses, weights, label_weight

    @property
    def needs_hidden(self) -> bool:
        return any(getattr(loss, "needs_hidden", False) for loss in self.losses.values())

    def __call__(self, student: ModelOutputs, teacher: ModelOutputs, mask: torch.Tensor,
                 label_loss: Optional[tuple[torch.Tensor, torch.Tensor, dict]] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """-> (weighted total, number of loss tokens, {name: (sum, count)} to log).

        label_loss: (sum, count, extras) of the student's own objective (cross-entropy, MTP terms)."""
        num_tokens = mask.sum()
        total = torch.zeros((), device=mask.device, dtype=torch.float32)
        extras: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if label_loss is not None:
            value, count, label_extras = label_loss
            if self.label_weight > 0:
                total = total + self.label_weight * value
            extras.update(label_extras)
            extras.setdefault("lm_loss", (value.detach(), count))
        for name, loss in self.losses.items():
            value, count, report = loss(student, teacher, mask)
            if self.weights[name] > 0:
                total = total + self.weights[name] * value
            extras[f"distill_{name}"] = (value.detach(), count)
            for key, v in report.items():
                extras[f"distill_{name}_{key}"] = (v.detach(), count)
        return total, num_tokens, extras
