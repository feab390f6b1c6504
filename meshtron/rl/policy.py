"""The rollout side of a sharded policy: the engine's own whole model kept equal to the trained one.

Under FSDP, HSDP, expert or context parallelism (and tensor parallelism combined with any of them)
the trained policy is sharded, and its forward is a collective, so it cannot serve an engine that
each rank steps on its own prompts. Each rank then keeps a plain (single-device) rollout model and,
before rollouts, copies the policy into it one tensor at a time: `DTensor.full_tensor()` all-gathers
one parameter over its mesh (every rank walks the same names in the same order, so the collectives
match), the whole tensor is copied and freed before the next. Gradients and optimizer state are
never gathered. Under pipeline parallelism each rank gathers its own stages and `ReplicaSync`
(rl/pipeline.py) broadcasts every stage from its owner over the pp group.

The frozen reference policy of the KL penalty is placed like the trained one (`frozen_copy`): built
through the same parallelisation and given each local shard, so its forward needs no gathering
beyond what the policy's does.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.config.schema import RunConfig
from meshtron.models.gpt import GPTModel
from meshtron.nn.moe.replay import WRAPPER_NAMES
from meshtron.parallel import parallelize_parts
from meshtron.parallel.dims import ParallelDims


def plain_name(name: str) -> str:
    """A state-dict name without the wrappers activation checkpointing, compile and FSDP add."""
    for wrapper in WRAPPER_NAMES:
        name = name.replace(wrapper, "")
    return name


@torch.no_grad()
def gather_weights(policy: nn.Module, rollout_model: nn.Module) -> list[str]:
    """Copy `policy`'s (possibly sharded) weights into `rollout_model`, one tensor at a time; -> the
    names copied (the policy's own: under pp, this rank's stages)."""
    target = rollout_model.state_dict()
    copied = []
    for name, value in policy.state_dict().items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        key = plain_name(name)
        target[key].copy_(whole)
        copied.append(key)
        del whole
    return copied


def gather_objects(items: list, groups: list) -> list:
    """Every rank's list concatenated in rank order over the product of `groups` (innermost first)."""
    for group in groups:
        out: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, items, group=group)
        items = [x for part in out for x in part]
    return items


@torch.no_grad()
def frozen_copy(policy_parts: list[nn.Module], cfg: RunConfig, dims: ParallelDims, mesh, vocab_size: int,
                device: torch.device, stages: Optional[tuple[list[range], list[int]]] = None) -> list[nn.Module]:
    """Frozen parts holding `policy_parts`' weights, parallelised like them (without activation
    checkpointing or compile: no backward runs through them). `stages`: (the layer range of every
    pipeline stage, this rank's stage ids) under pp."""
    with torch.random.fork_rng(devices=[]):  # the random stream stays the single process's
        model = GPTModel(cfg.model, vocab_size).to(device)
    parts: list[nn.Module] = [model]
    if stages is not None:
        from meshtron.parallel.pipeline_stages import build_stage_modules

        parts = build_stage_modules(model, *stages)
    plain = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, activation_checkpoint="none",
                                                                  compile=False))
    parallelize_parts(parts, dims, mesh, plain)
    for part, trained in zip(parts, policy_parts):
        source = {plain_name(k): v for k, v in trained.state_dict().items()}
        for name, target in part.state_dict().items():
            value = source[plain_name(name)]
            local = target.to_local() if isinstance(target, DTensor) else target
            local.copy_(value.to_local() if isinstance(value, DTensor) else value)
        part.eval().requires_grad_(False)
    return parts
