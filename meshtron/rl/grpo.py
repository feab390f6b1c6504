"""The pieces of a GRPO update that are not the trainer's: advantages, the seeded split into
mini-batches, the packed training rows, and the per-micro-batch objectives the trainer's
accumulate/step runs (`meshtron.rl.trainer`): the GRPO policy loss and the warm-up's weighted
cross-entropy. Gradient reduction, clipping, non-finite skipping and the optimizer step are the
trainer's (FSDP reduce-scatters the gradients; tensor-parallel shards stay sharded).

Normalisers are global: the token weights of a mini-batch divide by its completion tokens or
sequences summed over every rank, so each rank adds its weighted token losses and the reduced
gradient is the gradient of the whole mini-batch's loss (the trainer divides by 1).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtron.nn.context import PackedContext
from meshtron.parallel.distributed import group_device
from meshtron.parallel.loss import vocab_parallel_log_probs
from meshtron.rl.loss import (
    PolicyLossConfig,
    clip_rewards,
    group_advantages,
    policy_loss,
    token_entropy,
    token_log_probs,
    token_weights,
)
from meshtron.rl.packing import TrainSequence
from meshtron.rl.replay import replay_routing
from meshtron.rl.rollout import Rollout

SUM_STATS = ("tokens", "clipped_low", "clipped_high", "ratio", "is_weight", "kl", "entropy", "logprob_gap")


def world_group(group=None):
    """The group to reduce over: `group`, or all ranks when None; None when it has one rank."""
    if group is not None:
        return group if dist.get_world_size(group) > 1 else None
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def all_reduce(values: list[float], op=None, group=None) -> list[float]:
    """Reduce a few numbers over `group` (sum by default); unchanged in a single process."""
    group = world_group(group)
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=group_device(group))  # NCCL takes no CPU tensor
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t.tolist()


def log_probs_of(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                 entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p of each label, entropy of each position) under softmax(logits / temperature); the
    entropy is detached unless `entropy_grad`. Vocabulary-sharded (TP) logits never gather."""
    if isinstance(logits, DTensor):  # tensor parallel: logits sharded over the vocabulary
        log_probs, entropy = vocab_parallel_log_probs(logits, labels, temperature)
        return log_probs, entropy if entropy_grad else entropy.detach()
    log_probs = token_log_probs(logits, labels, temperature)
    if entropy_grad:
        return log_probs, token_entropy(logits, temperature)
    with torch.no_grad():
        return log_probs, token_entropy(logits.detach(), temperature)


def forward_log_probs(model: torch.nn.Module, mb: dict[str, torch.Tensor], temperature: float,
                      entropy_grad: bool = False, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`log_probs_of` the model's logits for mb, (rows, L); `ctx`: the micro-batch's model context
    (the trainer's: this rank's part under CP), by default its packed documents."""
    if ctx is None:
        ctx = PackedContext.for_tokens(mb["input_ids"], mb["document_ids"], mb["position_ids"])
    with replay_routing(model, mb):  # MoE: the experts the rollout engine chose, when recorded
        logits = model(mb["input_ids"], ctx)
    return log_probs_of(logits, mb["labels"], temperature, entropy_grad)


def assign_advantages(rollouts: Sequence[Rollout], group_size: int, scale_by_std: bool,
                      reward_clip: Optional[float]) -> torch.Tensor:
    """Set each rollout's advantage from its group; return the (clipped) rewards."""
    rewards = clip_rewards(torch.tensor([r.reward for r in rollouts], dtype=torch.float32), reward_clip)
    for r, a in zip(rollouts, group_advantages(rewards, group_size, scale_by_std).tolist()):
        r.advantage = a
    return rewards


def split_mini_batches(rollouts: Sequence[Rollout], num: int, seed: int, step: int, first_group: int,
                       num_groups: int, group_size: int) -> list[list[Rollout]]:
    """`num` mini-batches from a seeded shuffle of the step's rollouts over all ranks (groups
    first_group .. first_group + num_groups - 1): mini-batch k holds the rollouts whose shuffled
    position is k modulo num, so the split does not depend on how ranks share the prompts."""
    position = list(range(num_groups * group_size))
    random.Random(f"{seed}/{step}/minibatch").shuffle(position)
    out: list[list[Rollout]] = [[] for _ in range(num)]
    for r in rollouts:
        out[position[(r.group - first_group) * group_size + r.sample] % num].append(r)
    return out


def train_sequences(rollouts: Sequence[Rollout], aggregation: str, max_new_tokens: int,
                    group=None) -> list[TrainSequence]:
    lengths = [len(r.completion_ids) for r in rollouts]
    total_tokens, total_seqs = all_reduce([float(sum(lengths)), float(len(lengths))], group=group)
    weights = token_weights(lengths, aggregation, max_new_tokens, int(total_tokens), int(total_seqs))
    return [TrainSequence(r.prompt_ids + r.completion_ids, len(r.prompt_ids), w, r.advantage, r.log_probs,
                          r.routing) for r, w in zip(rollouts, weights)]


def grpo_loss(log_probs: torch.Tensor, entropy: torch.Tensor, mb: dict[str, torch.Tensor], cfg: PolicyLossConfig,
              ref_log_probs: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective of one micro-batch: (weighted loss sum, token statistics). The log probs of
    the weights that sampled it are mb["old_log_probs"] when the step has several mini-batches, else
    these log probs (detached: the ratio is 1 with the gradient of the policy)."""
    old = mb.get("old_log_probs", log_probs.detach())
    return policy_loss(log_probs, old, mb["advantages"], mb["weights"], cfg, rollout_log_probs=mb["rollout_log_probs"],
                       ref_log_probs=ref_log_probs, entropy=entropy)


def supervised_loss(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The warm-up objective: cross-entropy on the demonstration tokens (weights already normalised);
    -> (loss, {"correct": labels that are the argmax, "tokens": trained tokens})."""
    if isinstance(logits, DTensor):
        log_probs = vocab_parallel_log_probs(logits, mb["labels"])[0]
    else:
        log_probs = token_log_probs(logits, mb["labels"])
    loss = -(log_probs * mb["weights"]).sum()
    with torch.no_grad():
        trained = mb["weights"] > 0
        # the label is the argmax when its log prob is the largest: p >= every other p
        best = logits.full_tensor().argmax(-1) if isinstance(logits, DTensor) else logits.argmax(-1)
        stats = {"correct": ((best == mb["labels"]) & trained).sum(), "tokens": trained.sum()}
    return loss, stats
