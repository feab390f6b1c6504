"""GRPO and the supervised warm-up under pipeline parallelism.

Training runs through the same schedules as `meshtron train` (`parallel.pipeline.Pipeline`); only
the loss differs: the last stage turns each micro-batch's logits into token log probs and computes
the GRPO policy loss (or the warm-up's weighted cross-entropy) against the packed rows' advantages,
weights and rollout log probs. The log probs of the weights that sampled a mini-batch, and of the
frozen reference model for the KL penalty, come from forward-only passes
(`parallel.pipeline_eval.forward_only`) and live on the last stage, the only one that needs them.

A pipeline step has a fixed shape: the packed micro-batches are padded with rows of padding
(weight 0, so no loss and no gradient) to micro_batch_size rows each, and their count to a
multiple of pp, which every schedule accepts.

Rollouts need the whole model. Every pipeline rank keeps the full model it built (its own stages
share their parameters with it) and, before rollouts, receives the other stages' current weights
from their owners (`ReplicaSync`): one broadcast per pp rank, of everything that rank owns. The
pp ranks of a data-parallel replica then split its prompts, generate, and all-gather the rollouts,
so rollouts run on every rank at once and each pp rank trains on the same packed rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from meshtron.parallel.clip import clip_grad_norm_
from meshtron.parallel.pipeline import Pipeline
from meshtron.rl.grpo import GRPOUpdate, all_reduce, all_reduce_gradients
from meshtron.rl.loss import PolicyLossConfig, policy_loss, token_entropy, token_log_probs
from meshtron.rl.packing import TrainSequence, micro_batches, pack_sequences


class RLPipeline(Pipeline):
    """The pipeline with the RL losses on its last stage. `mode` is "grpo" or "supervised"; the
    per-micro-batch statistics of the last stage's losses are kept in `stats` (empty elsewhere)."""

    def configure(self, mode: str, temperature: float = 1.0, loss_cfg: Optional[PolicyLossConfig] = None) -> None:
        self.mode, self.temperature, self.loss_cfg = mode, temperature, loss_cfg
        self.stats: dict[int, dict[str, Any]] = {}
        self.objective = self.rl_loss

    def rl_loss(self, logits: torch.Tensor, mb: dict[str, torch.Tensor], i: int) -> torch.Tensor:
        """The last stage's loss of micro-batch i (it carries its own normalisers: steps run with
        total_tokens=1, so loss_scale is 1)."""
        if self.mode == "supervised":
            log_probs = token_log_probs(logits, mb["labels"])
            loss = -(log_probs * mb["weights"]).sum()
            with torch.no_grad():
                trained = mb["weights"] > 0
                correct = ((logits.argmax(-1) == mb["labels"]) & trained).sum()
                stats = {"loss": loss.detach(), "correct": correct, "tokens": trained.sum()}
        else:
            log_probs = token_log_probs(logits, mb["labels"], self.temperature)
            if self.loss_cfg.entropy_coef > 0:
                entropy = token_entropy(logits, self.temperature)
            else:
                with torch.no_grad():
                    entropy = token_entropy(logits.detach(), self.temperature)
            old = mb.get("old_log_probs", log_probs.detach())
            loss, stats = policy_loss(log_probs, old, mb["advantages"], mb["weights"], self.loss_cfg,
                                      rollout_log_probs=mb["rollout_log_probs"], ref_log_probs=mb.get("ref_log_probs"),
                                      entropy=entropy)
            stats = {**stats, "loss": loss.detach()}
        self.stats[i] = stats  # (the stage's shape inference calls this once for 0; the schedule overwrites it)
        return loss

    def train(self, micro_batches: list[dict[str, torch.Tensor]], rows: int) -> list[dict[str, Any]]:
        """Forward and backward of `micro_batches` (padded to the pipeline's shape: `rows` rows each); the
        losses carry their own normalisers. -> the real micro-batches' statistics on the last stage, []
        elsewhere."""
        n = len(micro_batches)
        self.stats = {}
        self.train_step(pad_micro_batches(micro_batches, rows, self.num_ranks), total_tokens=1.0)
        stats, self.stats = [self.stats[i] for i in range(n)] if self.has_last else [], {}
        return stats

    @torch.no_grad()
    def log_probs(self, parts: Sequence[nn.Module], micro_batches: list[dict[str, torch.Tensor]], key: str,
                  temperature: float) -> None:
        """Forward only through `parts` (this pipeline's stages or a frozen copy of them); the last stage
        stores each micro-batch's token log probs under mb[key]."""

        def keep(logits: torch.Tensor, i: int) -> None:
            micro_batches[i][key] = token_log_probs(logits, micro_batches[i]["labels"], temperature)

        self.forward_only(list(parts), micro_batches, keep)

    @property
    def num_ranks(self) -> int:
        return dist.get_world_size(self.group)


class PipelineGRPOUpdate(GRPOUpdate):
    """`GRPOUpdate` through the pipeline: `model` holds this rank's stages (`ModelParts`), `ref_parts`
    a frozen copy of them for the KL penalty. Statistics come from the last stages and are summed
    over every rank."""

    def __init__(self, pipeline: RLPipeline, ref_parts: Optional[list[nn.Module]], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pipeline, self.ref_parts = pipeline, ref_parts

    @property
    def stats_group(self):
        return None  # every rank: only last-stage ranks contribute

    def _batches(self, rollouts):
        before = self.num_tokens
        out = super()._batches(rollouts)
        if not self.pipeline.has_last:  # counted once per pipeline
            self.num_tokens = before
        return out

    def _old_log_probs(self, batch: list[dict[str, torch.Tensor]]) -> None:
        self.pipeline.log_probs(self.pipeline.parts, batch, "old_log_probs", self.cfg.temperature)

    def _train_batch(self, batch: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
        if self.ref_parts is not None and self.cfg.kl_beta > 0:
            self.pipeline.log_probs(self.ref_parts, batch, "ref_log_probs", self.cfg.temperature)
        self.pipeline.configure("grpo", self.cfg.temperature, self.loss_cfg)
        return self.pipeline.train(batch, self.micro_batch_size)

    def _clip(self) -> float:
        clip = self.clip_grad if self.clip_grad > 0 else float("inf")
        return clip_grad_norm_(list(self.model.parameters()), clip, self.pipeline.group,
                               duplicates=tuple(self.pipeline.tied_copies()))


def pipeline_supervised_step(pipeline: RLPipeline, model: nn.Module, optimizer: torch.optim.Optimizer,
                             sequences: list[TrainSequence], pack_length: int, pad_id: int, micro_batch_size: int,
                             device: torch.device, lr: float, clip_grad: float, group=None) -> dict[str, float]:
    """`grpo.supervised_step` through the pipeline (`model`: this rank's stages; `group`: data-parallel)."""
    model.train()
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    rows = pack_sequences(sequences, pack_length, pad_id)
    batch = [{k: v.to(device) for k, v in mb.items()} for mb in micro_batches(rows, micro_batch_size)]
    pipeline.configure("supervised")
    stats = pipeline.train(batch, micro_batch_size)
    all_reduce_gradients(model, group)
    grad_norm = clip_grad_norm_(list(model.parameters()), clip_grad if clip_grad > 0 else float("inf"),
                                pipeline.group, duplicates=tuple(pipeline.tied_copies()))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, correct, tokens = all_reduce([sum(float(s[k]) for s in stats) for k in ("loss", "correct", "tokens")])
    return {"loss": loss_sum, "token_accuracy": correct / max(tokens, 1.0), "grad_norm": grad_norm, "lr": lr}


def pad_micro_batches(micro_batches: list[dict[str, torch.Tensor]], rows: int,
                      pp: int) -> list[dict[str, torch.Tensor]]:
    """Every micro-batch padded to `rows` rows, and their count to a multiple of pp (at least pp), with
    rows that train nothing: a pipeline schedule's shapes are fixed from its first step, and 1F1B
    wants pp or more micro-batches, interleaved schedules a multiple of pp."""

    def padded(mb: dict[str, torch.Tensor], have: int) -> dict[str, torch.Tensor]:
        if have == rows:
            return mb
        return {k: torch.cat([v, filler(k, v, rows - have)]) if v.dim() >= 2 else v for k, v in mb.items()}

    def filler(key: str, like: torch.Tensor, count: int) -> torch.Tensor:
        if key == "position_ids":
            return torch.arange(like.shape[1], device=like.device).expand(count, -1).clone()
        # token id 0 (any valid id), one document, and zero weights, advantages and log probs
        return torch.zeros(count, *like.shape[1:], dtype=like.dtype, device=like.device)

    out = [padded(mb, mb["input_ids"].shape[0]) for mb in micro_batches]
    target = max(pp, -(-len(out) // pp) * pp)
    while len(out) < target:
        out.append(padded({k: v[:0] if v.dim() >= 2 else v for k, v in micro_batches[0].items()}, 0))
    return out


class ReplicaSync:
    """Copies every pipeline stage's weights into the full model each pp rank keeps for rollouts.
    `owned` are this rank's state-dict names (its stages', single-process names). Each name comes
    from the lowest pp rank that owns it, in one coalesced broadcast per pp rank."""

    def __init__(self, model: nn.Module, owned: set[str], group: dist.ProcessGroup):
        self.model, self.group = model, group
        names = [None] * dist.get_world_size(group)
        dist.all_gather_object(names, sorted(owned), group=group)
        state = model.state_dict()
        missing = set(state) - set().union(*map(set, names))
        if missing:
            raise RuntimeError(f"no pipeline stage holds {sorted(missing)[:3]}: the rollout model cannot be synced")
        self.plan: list[list[str]] = [[] for _ in names]  # per pp rank: the names it sends
        taken: set[str] = set()
        for rank, mine in enumerate(names):
            for name in mine:
                if name in state and name not in taken:
                    self.plan[rank].append(name)
                    taken.add(name)

    @torch.no_grad()
    def __call__(self) -> None:
        state = self.model.state_dict()
        me = dist.get_rank(self.group)
        for src, names in enumerate(self.plan):
            if not names:
                continue
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for n in names:
                by_dtype.setdefault(state[n].dtype, []).append(state[n])
            for tensors in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in tensors])
                dist.broadcast(flat, group=self.group, group_src=src)
                if me != src:
                    at = 0
                    for t in tensors:
                        t.copy_(flat[at:at + t.numel()].view(t.shape))
                        at += t.numel()


def gather_objects(items: list, group: dist.ProcessGroup) -> list:
    """Every rank's list, concatenated in rank order, on every rank of `group`."""
    out: list[Optional[list]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, items, group=group)
    return [x for part in out for x in part]
