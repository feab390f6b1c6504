"""Knowledge distillation: a frozen teacher, pluggable losses, a loss balancer, and the trainer
extension that runs them (`meshtron distill --config C`)."""

from meshtron.distill.balancer import LossBalancer
from meshtron.distill.losses import (
    LOSSES,
    DistillLoss,
    HiddenCosine,
    HiddenMSE,
    LogitsKL,
    ModelOutputs,
    TopKLogitsKL,
    build_losses,
)
from meshtron.distill.trainer import DistillTrainer

__all__ = ["LOSSES", "DistillLoss", "DistillTrainer", "HiddenCosine", "HiddenMSE", "LogitsKL", "LossBalancer",
           "ModelOutputs", "TopKLogitsKL", "build_losses"]
