"""The GRPO family of policy losses: group-normalised advantages, the PPO clipped ratio with separate
low/high epsilon, a k3 KL penalty to a frozen reference, an entropy bonus, and truncated importance
sampling between the rollout engine's and the trainer's log probabilities.

For completion token t of sequence i, with ratio r = exp(logp - logp_old):
    pg_t   = max(-A_i r, -A_i clip(r, 1 - eps_low, 1 + eps_high))          (PPO clipped surrogate)
    pg_t  *= min(exp(logp_old - logp_rollout), C)                           (truncated IS, detached)
    kl_t   = exp(ref - logp) - (ref - logp) - 1                             (k3 estimator, >= 0)
    loss_t = pg_t + beta kl_t - entropy_coef H_t
Aggregation turns token losses into one number; every variant is a weight per token, so that
micro-batches and data-parallel ranks simply add their weighted sums:
    token_mean    (DAPO)      w = 1 / (completion tokens of the whole batch)
    sequence_mean (GRPO)      w = 1 / (|o_i| * sequences of the batch)
    fixed_length  (Dr.GRPO)   w = 1 / (max_new_tokens * sequences of the batch)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

AGGREGATIONS = ("token_mean", "sequence_mean", "fixed_length")


def clip_rewards(rewards: torch.Tensor, clip: Optional[float]) -> torch.Tensor:
    """Rewards clipped to [-clip, clip] (None leaves them)."""
    return rewards if clip is None else rewards.clamp(-clip, clip)


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards (num_groups * group_size,), consecutive groups -> advantages of the same shape.

    A_i = r_i - mean(group), divided by (std(group) + eps) when `scale_by_std` (GRPO; the sample
    std with Bessel's correction, as torch.std); Dr.GRPO leaves the std out.
    """
    assert rewards.numel() % group_size == 0 and group_size >= 2, "rewards must fill whole groups of >= 2"
    r = rewards.reshape(-1, group_size).double()
    centred = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1).to(rewards.dtype)


def zero_variance_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Share of groups whose rewards are all equal (they carry no learning signal)."""
    r = rewards.reshape(-1, group_size)
    return float((r.max(dim=1).values == r.min(dim=1).values).float().mean())


def token_weights(completion_lengths: list[int], aggregation: str, max_new_tokens: int,
                  total_tokens: Optional[int] = None, total_sequences: Optional[int] = None) -> list[float]:
    """The weight of each completion token of each sequence (one float per sequence; every token of a
    sequence weighs the same). Totals default to these sequences; give the global ones when several
    ranks or mini-batches share one normaliser."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation {aggregation!r}: choose one of {AGGREGATIONS}")
    num_tokens = total_tokens if total_tokens is not None else sum(completion_lengths)
    num_seqs = total_sequences if total_sequences is not None else len(completion_lengths)
    if aggregation == "token_mean":
        return [1.0 / max(num_tokens, 1)] * len(completion_lengths)
    if aggregation == "sequence_mean":
        return [1.0 / (max(n, 1) * max(num_seqs, 1)) for n in completion_lengths]
    return [1.0 / (max_new_tokens * max(num_seqs, 1))] * len(completion_lengths)


@dataclass
class PolicyLossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_beta: float = 0.0
    entropy_coef: float = 0.0
    is_truncation: Optional[float] = 2.0  # C of truncated importance sampling; None turns the correction off


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (..., vocab), labels (...) -> log p(label) under softmax(logits / temperature), fp32."""
    logp = (logits.float() / temperature).log_softmax(-1)
    return logp.gather(-1, labels[..., None].long())[..., 0]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (..., vocab) -> entropy of softmax(logits / temperature), fp32."""
    logp = (logits.float() / temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                weights: torch.Tensor, cfg: PolicyLossConfig, *, rollout_log_probs: Optional[torch.Tensor] = None,
                ref_log_probs: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token tensors of one shape (padding and prompt tokens carry weight 0) -> (weighted loss
    sum, sums of statistics over the tokens with weight > 0: 'tokens', 'clipped_low', 'clipped_high',
    'ratio', 'is_weight', 'is_weight_max', 'is_weight_min', 'kl', 'entropy', 'logprob_gap')."""
    mask = weights > 0
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg = torch.maximum(-advantages * ratio, -advantages * clipped)
    is_weight = torch.ones_like(ratio)
    if rollout_log_probs is not None and cfg.is_truncation is not None:
        is_weight = torch.exp(old_log_probs - rollout_log_probs).detach().clamp(max=cfg.is_truncation)
        pg = pg * is_weight
    loss = pg
    kl = torch.zeros_like(ratio)
    if ref_log_probs is not None:
        delta = ref_log_probs - log_probs
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + cfg.kl_beta * kl
    if entropy is not None and cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * entropy
    total = (loss * weights).sum()
    with torch.no_grad():
        m = mask.float()
        stats = {
            "tokens": m.sum(),
            # the clip is active where the clipped term is the larger (the gradient through r is cut)
            "clipped_low": (m * ((ratio < 1 - cfg.clip_eps_low) & (advantages < 0)).float()).sum(),
            "clipped_high": (m * ((ratio > 1 + cfg.clip_eps_high) & (advantages > 0)).float()).sum(),
            "ratio": (m * ratio).sum(),
            "is_weight": (m * is_weight).sum(),
            "is_weight_max": torch.where(mask, is_weight, -torch.inf).max() if mask.any() else m.new_tensor(1.0),
            "is_weight_min": torch.where(mask, is_weight, torch.inf).min() if mask.any() else m.new_tensor(1.0),
            "kl": (m * kl).sum(),
            "entropy": (m * entropy).sum() if entropy is not None else m.new_zeros(()),
            "logprob_gap": (m * (old_log_probs - rollout_log_probs).abs()).sum()
            if rollout_log_probs is not None else m.new_zeros(()),
        }
    return total, stats
