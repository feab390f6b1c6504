"""MoE router replay for RL: train every token through the experts the rollout engine chose for it.

The engine and the trainer compute the same tokens in different batches (a varlen row of the step's
chunks vs packed training rows), so near-tied router scores can pick different experts and the
trainer's log probs would then belong to another network than the one that sampled. Replay removes
that gap:

- recording (`EngineRoutingRecorder`): while the engine generates, each router runs in RECORD mode
  and the engine's step hook (which sees each step's scheduled chunks before its forward) lets every
  step's recorded (tokens, k) choices be split by chunk: request r's chunk covering positions [start, start + n) of its sequence owns rows
  [at, at + n) of the step's varlen row. After generation each request has, per router, the experts
  of positions 0 .. len(prompt) + len(completion) - 2, exactly the trainer's input positions. A
  preempted request that is recomputed overwrites its positions (same weights, same tokens).
  The engine must run the varlen layout without CUDA graphs and without prefix caching (a cached
  prefix is never recomputed, so its routing would be missing); `routing_engine_config` sets that.
- replaying (`replay_routing`): packed rows carry, per router, a (rows, L, k) table of expert ids
  (`pack_sequences` places each sequence's table where its tokens go; padding gets experts
  0 .. k-1); the trainer's forward queues the tables as REPLAY_FORWARD targets, in the flattened
  token order the MoE layer uses. Probabilities still come from the trainer's own scores, so the
  router gets its gradient as if it had chosen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from meshtron.nn.moe.replay import ReplayMode, clear_replay, replays, set_replay_targets

ROUTING_PREFIX = "routing/"  # packed-row keys: "routing/<router name>" -> (L, k) expert ids


def has_routers(model: torch.nn.Module) -> bool:
    return bool(replays(model))


def routing_engine_config(cfg):
    """The engine settings under which recorded routing covers every position of every request."""
    return replace(cfg, enable_prefix_caching=False, layout="varlen", cuda_graphs=False)


class EngineRoutingRecorder:
    """Wraps an `LLMEngine`'s runner so that its forwards record each request's routing."""

    def __init__(self, engine, model: torch.nn.Module):
        self.engine, self.routers = engine, replays(model)
        self.parts: dict[str, list[tuple[int, dict[str, np.ndarray]]]] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Inside, the engine's steps record routing. The engine's `step_hook` hands over each step's
        chunks just before that step's forward; the forward's choices are split when the next step
        starts (or when recording ends). An earlier hook (the TP leader's broadcast) still runs."""
        cfg = self.engine.runner.cfg
        assert cfg.layout == "varlen" and not cfg.cuda_graphs and not cfg.enable_prefix_caching, \
            "router replay needs routing_engine_config(...)"
        previous = self.engine.step_hook
        pending: list = []
        self.parts = {}

        def flush() -> None:
            if pending:
                self._split(pending.pop())

        def hook(kind: str, payload=None) -> None:
            if previous is not None:
                previous(kind, payload)
            if kind == "step":
                flush()
                pending.append(payload)

        for r in self.routers.values():
            r.recorded, r.mode = [], ReplayMode.RECORD
        self.engine.step_hook = hook
        try:
            yield
            flush()
        finally:
            self.engine.step_hook = previous
            for r in self.routers.values():
                r.recorded, r.mode = [], None

    def _split(self, chunks) -> None:
        step = {}
        for name, r in self.routers.items():
            assert len(r.recorded) == 1, f"router {name}: {len(r.recorded)} forwards in one engine step"
            step[name] = r.recorded[0].cpu().numpy()  # inference-mode tensor -> plain array
            r.recorded = []
        total = sum(len(c.token_ids) for c in chunks)
        at = 0
        for c in chunks:
            n = len(c.token_ids)
            for name, table in step.items():
                assert table.shape[0] == total, f"router {name}: {table.shape[0]} tokens, the step has {total}"
            self.parts.setdefault(c.req_id, []).append((c.start_pos, {k: v[at:at + n] for k, v in step.items()}))
            at += n

    def routing(self, req_id: str, num_positions: int) -> dict[str, np.ndarray]:
        """{router name: (num_positions, k) expert ids} of positions 0 .. num_positions - 1 of a request."""
        out = {}
        for name in self.routers:
            k = next(t[name].shape[1] for _, t in self.parts[req_id])
            table = np.full((num_positions, k), -1, dtype=np.int64)
            for start, tables in self.parts[req_id]:  # in step order: a recomputation overwrites
                rows = tables[name][: max(0, num_positions - start)]
                table[start:start + len(rows)] = rows
            if (table < 0).any():
                missing = int(np.argmax((table < 0).any(1)))
                raise RuntimeError(f"router replay: request {req_id} has no recorded routing at position {missing}")
            out[name] = table
        return out

    def forget(self) -> None:
        self.parts = {}


def pack_routing(row: dict[str, np.ndarray], routing: Optional[dict[str, np.ndarray]], at: int, n: int,
                 pack_length: int) -> None:
    """Place a sequence's (n, k) routing tables at positions [at, at + n) of a packed row."""
    if routing is None:
        return
    for name, table in routing.items():
        key = ROUTING_PREFIX + name
        if key not in row:
            k = table.shape[1]
            row[key] = np.tile(np.arange(k, dtype=np.int64), (pack_length, 1))  # padding: any k distinct experts
        assert table.shape[0] >= n, f"routing of {table.shape[0]} positions for a sequence of {n}"
        row[key][at:at + n] = table[:n]


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside: the model's routers take the micro-batch's recorded experts instead of choosing
    (nothing changes when the micro-batch carries no routing)."""
    keys = [k for k in mb if k.startswith(ROUTING_PREFIX)]
    if not keys:
        yield
        return
    table = replays(model)
    assert {k[len(ROUTING_PREFIX):] for k in keys} == set(table), "routing for every router of the model"
    clear_replay(model)
    set_replay_targets(model, {k[len(ROUTING_PREFIX):]: [mb[k].reshape(-1, mb[k].shape[-1])] for k in keys})
    for r in table.values():
        r.mode = ReplayMode.REPLAY_FORWARD
    try:
        yield
        left = [name for name, r in table.items() if r.targets]
        assert not left, f"router {left[0]}: replay targets left unused"
    finally:
        for r in table.values():
            r.mode = None
