"""GRPO and the supervised warm-up under pipeline parallelism: what the trainer's pipeline path
(`parallel.pipeline.Pipeline`, driven by `Trainer.train_step`) needs besides its objective hook.

The last stage turns each micro-batch's logits into token log probs and computes the GRPO policy
loss (or the warm-up's weighted cross-entropy): `GRPOTrainer` installs that as `Pipeline.objective`.
The log probs of the weights that sampled a mini-batch, and of the frozen reference stages for the
KL penalty, come from `Pipeline.forward_only` and live on the last stage, the only one that needs them.

A pipeline step has a fixed shape: the packed micro-batches are padded with rows of padding
(weight 0, so no loss and no gradient) to micro_batch_size rows each, and their count to a
multiple of pp, which every schedule accepts (`pad_micro_batches`).

Rollouts with one stage per pp rank come from the pipeline-parallel engine (`rl.inference.
PipelineEngineBackend`), each rank holding a copy of its own stage. With virtual stages a rank's
stages are not one contiguous run of layers, so every pipeline rank keeps a whole rollout model;
before rollouts each rank gathers its own stages into it (rl/policy.py) and `ReplicaSync` sends
every stage from its owner: one broadcast per pp rank, of everything that rank owns. Either way the
pp ranks of a data-parallel replica split its prompts, generate, and all-gather the rollouts.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn


def pad_micro_batches(micro_batches: list[dict[str, torch.Tensor]], rows: Optional[int], pp: int,
                      at_least: int = 0) -> list[dict[str, torch.Tensor]]:
    """Every micro-batch padded to `rows` rows (None: left as they are), and their count to a multiple
    of pp (at least pp and `at_least`), with rows that train nothing: a pipeline schedule's shapes are
    fixed from its first step, and 1F1B wants pp or more micro-batches, interleaved schedules a multiple
    of pp; FSDP wants every data-parallel rank to run as many forwards (each one gathers parameters)."""
    fill = rows or micro_batches[0]["input_ids"].shape[0]

    def padded(mb: dict[str, torch.Tensor], have: int, rows: Optional[int] = rows) -> dict[str, torch.Tensor]:
        if rows is None or have == rows:
            return mb
        return {k: torch.cat([v, filler(k, v, rows - have)]) if v.dim() >= 2 else v for k, v in mb.items()}

    def filler(key: str, like: torch.Tensor, count: int) -> torch.Tensor:
        if key == "position_ids":
            return torch.arange(like.shape[1], device=like.device).expand(count, -1).clone()
        # token id 0 (any valid id), one document, and zero weights, advantages and log probs
        return torch.zeros(count, *like.shape[1:], dtype=like.dtype, device=like.device)

    out = [padded(mb, mb["input_ids"].shape[0]) for mb in micro_batches]
    target = max(pp, -(-max(len(out), at_least) // pp) * pp)
    while len(out) < target:
        out.append(padded({k: v[:0] if v.dim() >= 2 else v for k, v in micro_batches[0].items()}, 0, fill))
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
