"""Distillation losses: each compares the student's outputs with the frozen teacher's on the loss
tokens and returns (sum over tokens, number of tokens, report), so micro-batches and ranks are
normalised by the global token count exactly like the cross-entropy.

With p = softmax(z_teacher / T), q = softmax(z_student / T) over the vocabulary, per token:
    kl           T^2 * sum_v p_v (log p_v - log q_v)              forward KL(p || q), mass-covering
    reverse_kl   T^2 * sum_v q_v (log q_v - log p_v)              reverse KL(q || p), mode-seeking
    topk_kl      T^2 * KL(p~ || q~), p~ and q~ the softmaxes of both models' logits restricted to
                 the teacher's k largest (renormalised over those k tokens)
and, for layer pairs j = 1..J with student hidden states projected to the teacher's width (P_j h),
    hidden_cosine  (1/J) sum_j (1 - cos(P_j h_s, h_t))
    hidden_mse     (1/J) sum_j mean_d (P_j h_s - h_t)_d^2
T^2 keeps the gradient scale of the logits losses independent of the temperature (Hinton et al.).

A loss is any object with `__call__(student, teacher, mask)` (and `needs_hidden = True` if it reads
hidden states); register a new one in `LOSSES` (name -> builder taking the DistillConfig) and name
it in `distill.losses`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from meshtron.config.fields import ConfigError
from meshtron.config.schema import DistillConfig


@dataclass
class ModelOutputs:
    """What a loss sees of one model on one local micro-batch."""

    logits: torch.Tensor                                       # (batch, seq, vocab), full vocabulary
    hidden: list[torch.Tensor] = field(default_factory=list)   # per layer pair (batch, seq, teacher width)


class DistillLoss(Protocol):
    def __call__(self, student: ModelOutputs, teacher: ModelOutputs,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """mask (batch, seq) 0/1 -> (sum of per-token losses, number of tokens, report). The report
        holds extra per-token quantities, summed over the same tokens, that are logged as means."""
        ...


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """Half-precision values are compared in fp32 (softmax and reductions); fp32/fp64 stay as they are."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _masked_sum(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (per_token * mask.to(per_token.dtype)).sum()


class LogitsKL:
    """Forward (reverse=False) or reverse KL between the temperature-scaled distributions."""

    def __init__(self, temperature: float = 1.0, reverse: bool = False):
        self.temperature, self.reverse = temperature, reverse

    def __call__(self, student, teacher, mask):
        t = self.temperature
        log_q = F.log_softmax(_upcast(student.logits) / t, dim=-1)
        log_p = F.log_softmax(_upcast(teacher.logits) / t, dim=-1)
        if self.reverse:
            per_token = (log_q.exp() * (log_q - log_p)).sum(-1)
        else:
            per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
        return _masked_sum(per_token * t * t, mask), mask.sum(), {}


class TopKLogitsKL:
    """Forward KL over the teacher's k most likely tokens, both distributions renormalised over them.
    Reports `teacher_mass`: the teacher's full-vocabulary probability of those k tokens."""

    def __init__(self, k: int, temperature: float = 1.0):
        self.k, self.temperature = k, temperature

    def __call__(self, student, teacher, mask):
        t = self.temperature
        z_t = _upcast(teacher.logits) / t
        top, index = z_t.topk(min(self.k, z_t.shape[-1]), dim=-1)
        log_p = F.log_softmax(top, dim=-1)
        log_q = F.log_softmax(_upcast(student.logits).gather(-1, index) / t, dim=-1)
        per_token = (log_p.exp() * (log_p - log_q)).sum(-1) * t * t
        mass = (top.logsumexp(-1) - z_t.logsumexp(-1)).exp()
        return _masked_sum(per_token, mask), mask.sum(), {"teacher_mass": _masked_sum(mass.detach(), mask)}


class HiddenCosine:
    """1 - cosine similarity of each layer pair's hidden states, averaged over the pairs.
    Reports each pair's own value as `pair<j>`."""

    needs_hidden = True

    def __call__(self, student, teacher, mask):
        return _hidden_loss(student, teacher, mask, lambda s, t: 1.0 - F.cosine_similarity(s, t, dim=-1))


class HiddenMSE:
    """Mean squared error over the hidden dimension of each layer pair, averaged over the pairs."""

    needs_hidden = True

    def __call__(self, student, teacher, mask):
        return _hidden_loss(student, teacher, mask, lambda s, t: (s - t).square().mean(-1))


def _hidden_loss(student: ModelOutputs, teacher: ModelOutputs, mask: torch.Tensor,
                 per_token: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    assert student.hidden and len(student.hidden) == len(teacher.hidden)
    pairs = [per_token(_upcast(s), _upcast(t)) for s, t in zip(student.hidden, teacher.hidden)]
    total = _masked_sum(torch.stack(pairs).mean(0), mask)
    return total, mask.sum(), {f"pair{j}": _masked_sum(v.detach(), mask) for j, v in enumerate(pairs)}


LOSSES: dict[str, Callable[[DistillConfig], DistillLoss]] = {
    "kl": lambda cfg: LogitsKL(cfg.temperature),
    "reverse_kl": lambda cfg: LogitsKL(cfg.temperature, reverse=True),
    "topk_kl": lambda cfg: TopKLogitsKL(cfg.top_k, cfg.temperature),
    "hidden_cosine": lambda cfg: HiddenCosine(),
    "hidden_mse": lambda cfg: HiddenMSE(),
}


def build_losses(cfg: DistillConfig) -> dict[str, DistillLoss]:
    unknown = [name for name in cfg.losses if name not in LOSSES]
    if unknown:
        raise ConfigError(f"distill.losses: {unknown[0]!r} is not allowed; choose from: {', '.join(LOSSES)}")
    if len(set(cfg.losses)) != len(cfg.losses):
        raise ConfigError(f"distill.losses: {cfg.losses} names a loss twice; give each once (weights set the mix)")
    return {name: LOSSES[name](cfg) for name in cfg.losses}
