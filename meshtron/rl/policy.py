"""The rollout side of a sharded policy: the engine's own whole model kept equal to the trained one.

Under FSDP, HSDP, expert or context parallelism (and tensor parallelism combined with any of them)
the trained policy is sharded, and its forward is a collective, so it cannot serve an engine that
each rank steps on its own prompts. Each rank then keeps a plain (single-device) rollout model and,
before rollouts, copies the policy into it one tensor at a time: `DTensor.full_tensor()` all-gathers
one parameter over its mesh (every rank walks the same names in the same order, so the collectives
match), the whole tensor is copied and freed before the next. Gradients and optimizer state are
never gathered. Under pipeline parallelism each rank gathers its own stages and `ReplicaSync`
(rl/pipeline.py) broadcasts every stage from its owner over the pp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.nn.moe.replay import WRAPPER_NAMES


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
