"""Router replay: record each MoE layer's top-k expert choices and make a later forward use them.

Every built-in router owns a `RouterReplay` (a custom router may too; `set_replay_mode` refuses a
model with a MoE layer whose router has none, rather than record nothing). Its mode is one of
    None            route normally
    RECORD          route normally and append the chosen indices (tokens, k) to `recorded`
    REPLAY_FORWARD  take the next entry of `targets` (in forward order) instead of choosing, and keep
                    it for a recomputation in backward
    REPLAY_BACKWARD take the next kept entry: the recomputation of a forward (activation
                    checkpointing) routes as that forward did
Replayed indices still take their probabilities from this forward's scores, so gradients reach the
router exactly as if it had chosen them.

Order is per layer and first-in first-out: a layer sees micro-batch i's forward before micro-batch
i+1's under every pipeline schedule (stages run out of order across layers, never within one), and
recomputations in backward come in forward order too (1F1B, GPipe). A forward recomputed inside the
autograd engine while the mode is REPLAY_FORWARD is served as REPLAY_BACKWARD automatically; while
RECORD, a recomputation records nothing (the forward already did).
RL uses this so training routes each token exactly as the rollout did. Call `clear_replay(model)` after
each replayed step: without activation recompute nothing consumes the entries kept for backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Optional

import torch
from torch import nn

from meshtron.compat import in_autograd_backward


class ReplayMode(Enum):
    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


def _in_backward() -> bool:
    """True while the autograd engine runs (e.g. activation checkpointing recomputes a forward)."""
    return in_autograd_backward()


class RouterReplay:
    def __init__(self) -> None:
        self.mode: Optional[ReplayMode] = None
        self.paused = False  # route normally, record nothing (set by the MoE layer)
        self.recorded: list[torch.Tensor] = []
        self.targets: deque[torch.Tensor] = deque()
        self._for_backward: deque[torch.Tensor] = deque()

    def clear(self) -> None:
        self.recorded, self.targets, self._for_backward = [], deque(), deque()

    def select(self, scores: torch.Tensor, choose: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Top-k indices (tokens, k) for `scores` (tokens, experts): `choose(scores)`, recorded or replayed."""
        mode = self.mode
        if self.paused or scores.device.type == "meta":  # e.g. shape inference: nothing to record or replay
            mode = None
        if mode is ReplayMode.REPLAY_FORWARD and _in_backward():
            mode = ReplayMode.REPLAY_BACKWARD
        if mode is None:
            return choose(scores)
        if mode is ReplayMode.RECORD:
            indices = choose(scores)
            if not _in_backward():
                self.recorded.append(indices.detach().clone())
            return indices
        queue = self.targets if mode is ReplayMode.REPLAY_FORWARD else self._for_backward
        if not queue:
            raise RuntimeError(f"router replay ({mode.value}): no recorded routing left for this forward; "
                               "set targets for every forward (one entry per micro-batch, in order)")
        indices = queue.popleft().to(scores.device)
        if indices.shape[0] != scores.shape[0]:
            raise RuntimeError(f"router replay ({mode.value}): recorded routing has {indices.shape[0]} tokens, "
                               f"this forward has {scores.shape[0]}")
        if mode is ReplayMode.REPLAY_FORWARD:
            self._for_backward.append(indices)
        return indices


WRAPPER_NAMES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def replays(model: nn.Module) -> dict[str, RouterReplay]:
    """Every router's replay state by module name (single-process names, wrappers left out), in layer order."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "replay", None), RouterReplay):
            for wrapper in WRAPPER_NAMES:
                name = name.replace(wrapper, "")
            found[name] = module.replay
    return found


def set_replay_mode(model: nn.Module, mode: Optional[ReplayMode]) -> None:
    """Put every router in `mode`; refuse (before changing any) if a MoE layer's router cannot replay."""
    from meshtron.nn.moe.layer import MoELayer  # layer -> router -> replay: import here

    if mode is not None:
        for name, module in model.named_modules():
            router = getattr(module, "router", None) if isinstance(module, MoELayer) else None
            if router is not None and not isinstance(getattr(router, "replay", None), RouterReplay):
                raise ValueError(f"router replay: the router of {name or 'the model'} ({type(router).__name__}) "
                                 "has no replay support; give it `self.replay = RouterReplay()` and pick its "
                                 "indices with `self.replay.select(scores, choose)` (see docs/moe.md)")
    for replay in replays(model).values():
        replay.mode = mode


def clear_replay(model: nn.Module) -> None:
    for replay in replays(model).values():
        replay.clear()


def recorded_routing(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """{router name: [indices (tokens, k) per recorded forward]}."""
    return {name: list(r.recorded) for name, r in replays(model).items()}


def set_replay_targets(model: nn.Module, routing: dict[str, Iterable[torch.Tensor]]) -> None:
    """Queue recorded routing (as `recorded_routing` returns it) for REPLAY_FORWARD."""
    table = replays(model)
    unknown = sorted(set(routing) - set(table))
    if unknown:
        raise KeyError(f"router replay: no router named {unknown[0]!r}; routers: {', '.join(table)}")
    for name, entries in routing.items():
        table[name].targets.extend(entries)
