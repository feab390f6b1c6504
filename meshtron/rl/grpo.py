"""One GRPO update on a batch of scored rollouts: advantages, mini-batches packed into rows, the
trainer's log probabilities, the policy loss, gradient all-reduce over data-parallel ranks, and
optimizer steps. Also the supervised (warm-up) step on demonstrations, which shares the packing.

Normalisers are global: the token weights of a mini-batch divide by its completion tokens or
sequences summed over every rank, so each rank just adds its weighted token losses and the
all-reduced gradient is the gradient of the whole mini-batch's loss.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtron.nn.context import PackedContext
from meshtron.nn.moe.replay import clear_replay
from meshtron.parallel.clip import clip_grad_norm_
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
from meshtron.rl.packing import TrainSequence, micro_batches, pack_sequences
from meshtron.rl.replay import replay_routing
from meshtron.rl.rollout import Rollout
from meshtron.training.precision import autocast

SUM_STATS = ("tokens", "clipped_low", "clipped_high", "ratio", "is_weight", "kl", "entropy", "logprob_gap")


def world_group(group=None):
    """The data-parallel group to reduce over: `group` (under tensor parallelism) or all ranks; None
    when it has one rank."""
    if group is not None:
        return group if dist.get_world_size(group) > 1 else None
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def all_reduce(values: list[float], op=None, group=None) -> list[float]:
    """Reduce a few numbers over the data-parallel ranks (sum by default); unchanged in a single process."""
    group = world_group(group)
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=group_device(group))  # NCCL takes no CPU tensor
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t.tolist()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def all_reduce_gradients(model: torch.nn.Module, group=None) -> None:
    """Sum gradients over the data-parallel ranks (each rank's loss carries global normalisers);
    a tensor-parallel shard is reduced with the same shard of the other replicas."""
    group = world_group(group)
    if group is None:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # a rank with nothing to train this mini-batch still takes part
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [_local(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()


def forward_log_probs(model: torch.nn.Module, mb: dict[str, torch.Tensor], temperature: float,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p of each label, entropy of each position) under softmax(logits / temperature), (rows, L)."""
    ctx = PackedContext.for_tokens(mb["input_ids"], mb["document_ids"], mb["position_ids"])
    with replay_routing(model, mb):  # MoE: the experts the rollout engine chose, when recorded
        logits = model(mb["input_ids"], ctx)
    if isinstance(logits, DTensor):  # tensor parallel: logits sharded over the vocabulary
        log_probs, entropy = vocab_parallel_log_probs(logits, mb["labels"], temperature)
        return log_probs, entropy if entropy_grad else entropy.detach()
    log_probs = token_log_probs(logits, mb["labels"], temperature)
    if entropy_grad:
        return log_probs, token_entropy(logits, temperature)
    with torch.no_grad():
        return log_probs, token_entropy(logits.detach(), temperature)


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


class GRPOUpdate:
    """Runs the optimizer steps of one rollout batch."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rl_cfg, clip_grad: float,
                 pad_id: int, micro_batch_size: int, device: torch.device,
                 ref_model: Optional[torch.nn.Module] = None, group=None):
        self.num_tokens, self.group = 0, group  # group: data-parallel ranks (None: all)
        self.model, self.optimizer, self.cfg = model, optimizer, rl_cfg
        self.clip_grad, self.pad_id, self.micro_batch_size = clip_grad, pad_id, micro_batch_size
        self.device, self.ref_model = device, ref_model
        self.precision = "fp32"   # resolved train.precision; the trainer sets bf16 (autocast forwards)
        self.loss_cfg = PolicyLossConfig(rl_cfg.clip_eps_low, rl_cfg.clip_eps_high, rl_cfg.kl_beta,
                                         rl_cfg.entropy_coef, rl_cfg.is_truncation)

    def _batches(self, rollouts: Sequence[Rollout]) -> list[dict[str, torch.Tensor]]:
        seqs = train_sequences(rollouts, self.cfg.aggregation, self.cfg.max_new_tokens, self.group)
        self.num_tokens += sum(len(s.token_ids) - 1 for s in seqs)
        rows = pack_sequences(seqs, self.cfg.pack_length, self.pad_id)
        return [{k: v.to(self.device) for k, v in mb.items()} for mb in micro_batches(rows, self.micro_batch_size)]

    @torch.no_grad()
    def _old_log_probs(self, batches: list[dict[str, torch.Tensor]]) -> None:
        for mb in batches:
            with autocast(self.device, self.precision):
                mb["old_log_probs"] = forward_log_probs(self.model, mb, self.cfg.temperature)[0]

    def run(self, mini_batches: list[list[Rollout]], lr_at: Callable[[], float]) -> dict[str, float]:
        """One optimizer step per mini-batch; returns the step's statistics (global over ranks)."""
        self.model.train()
        self.num_tokens = 0
        batches = [self._batches(mb) for mb in mini_batches]
        if len(batches) > 1:  # later mini-batches need the log probs of the weights that sampled them
            for b in batches:
                self._old_log_probs(b)
        sums = dict.fromkeys(SUM_STATS, 0.0)
        extremes = {"is_weight_max": -float("inf"), "is_weight_min": float("inf")}
        loss_total, grad_norms = 0.0, []
        for batch in batches:
            lr = lr_at()
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            for stats in self._train_batch(batch):
                loss_total += float(stats["loss"])
                for k in SUM_STATS:
                    sums[k] += float(stats[k])
                extremes["is_weight_max"] = max(extremes["is_weight_max"], float(stats["is_weight_max"]))
                extremes["is_weight_min"] = min(extremes["is_weight_min"], float(stats["is_weight_min"]))
            all_reduce_gradients(self.model, self.group)
            grad_norms.append(self._clip())
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            clear_replay(self.model)  # entries kept for a backward recompute (none without checkpointing)
        group = self.stats_group
        values = all_reduce([sums[k] for k in SUM_STATS] + [loss_total], group=group)
        sums, loss_total = dict(zip(SUM_STATS, values[:-1])), values[-1]
        mx = all_reduce([extremes["is_weight_max"]], dist.ReduceOp.MAX if world_group(group) else None, group)[0]
        mn = all_reduce([extremes["is_weight_min"]], dist.ReduceOp.MIN if world_group(group) else None, group)[0]
        n = max(sums["tokens"], 1.0)
        return {"loss": loss_total / len(batches), "grad_norm": grad_norms[-1], "lr": lr,
                "kl": sums["kl"] / n, "entropy": sums["entropy"] / n,
                "clip_fraction": (sums["clipped_low"] + sums["clipped_high"]) / n,
                "clip_fraction_low": sums["clipped_low"] / n, "clip_fraction_high": sums["clipped_high"] / n,
                "ratio_mean": sums["ratio"] / n, "is_weight_mean": sums["is_weight"] / n, "is_weight_max": mx,
                "is_weight_min": mn, "logprob_gap": sums["logprob_gap"] / n,
                "train_tokens": all_reduce([float(self.num_tokens)], group=group)[0]}

    @property
    def stats_group(self):
        """Where the step's statistics are summed: the data-parallel ranks (each holds its own)."""
        return self.group

    def _train_batch(self, batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Forward and backward of one mini-batch's micro-batches; -> their statistics (with "loss")."""
        out = []
        for mb in batch:
            loss, stats = self._micro_batch(mb)
            loss.backward()
            out.append({**stats, "loss": loss.detach()})
        return out

    def _clip(self) -> float:
        clip = self.clip_grad if self.clip_grad > 0 else float("inf")
        return clip_grad_norm_(list(self.model.parameters()), clip)

    def _micro_batch(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with autocast(self.device, self.precision):   # the backward runs outside, as autocast asks
            log_probs, entropy = forward_log_probs(self.model, mb, self.cfg.temperature,
                                                   entropy_grad=self.cfg.entropy_coef > 0)
            ref = None
            if self.ref_model is not None and self.cfg.kl_beta > 0:
                with torch.no_grad():
                    ref = forward_log_probs(self.ref_model, mb, self.cfg.temperature)[0]
        old = mb.get("old_log_probs", log_probs.detach())
        return policy_loss(log_probs, old, mb["advantages"], mb["weights"], self.loss_cfg,
                           rollout_log_probs=mb["rollout_log_probs"], ref_log_probs=ref, entropy=entropy)


def supervised_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sequences: list[TrainSequence],
                    pack_length: int, pad_id: int, micro_batch_size: int, device: torch.device, lr: float,
                    clip_grad: float, group=None, precision: str = "fp32") -> dict[str, float]:
    """Cross-entropy on the demonstration tokens (weights already normalised); one optimizer step."""
    model.train()
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    rows = pack_sequences(sequences, pack_length, pad_id)
    loss_sum, correct, tokens = 0.0, 0.0, 0.0
    for mb in micro_batches(rows, micro_batch_size):
        mb = {k: v.to(device) for k, v in mb.items()}
        ctx = PackedContext.for_tokens(mb["input_ids"], mb["document_ids"], mb["position_ids"])
        with autocast(device, precision):
            logits = model(mb["input_ids"], ctx)
        if isinstance(logits, DTensor):
            log_probs = vocab_parallel_log_probs(logits, mb["labels"])[0]
        else:
            log_probs = token_log_probs(logits, mb["labels"])
        loss = -(log_probs * mb["weights"]).sum()
        loss.backward()
        loss_sum += loss.item()
        with torch.no_grad():
            trained = mb["weights"] > 0
            # the label is the argmax when its log prob is the largest: p >= every other p
            best = logits.full_tensor().argmax(-1) if isinstance(logits, DTensor) else logits.argmax(-1)
            correct += float(((best == mb["labels"]) & trained).sum())
            tokens += float(trained.sum())
    all_reduce_gradients(model, group)
    grad_norm = clip_grad_norm_(list(model.parameters()), clip_grad if clip_grad > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, correct, tokens = all_reduce([loss_sum, correct, tokens], group=group)
    return {"loss": loss_sum, "token_accuracy": correct / max(tokens, 1.0), "grad_norm": grad_norm, "lr": lr}
