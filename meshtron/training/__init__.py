"""Training: the loop, optimizer, learning-rate schedule, metrics and timers."""

from meshtron.training.trainer import StepResult, Trainer, TrainingError

__all__ = ["StepResult", "Trainer", "TrainingError"]
