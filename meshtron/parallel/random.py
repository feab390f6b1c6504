"""Dropout randomness per rank, with Megatron's semantics (its `model_parallel_cuda_manual_seed` and RNG
tracker), applied from outside the model.

A rank draws dropout masks from one of two streams:
- replicated: seeded from (train.seed, data rank over dp_replicate x dp_shard x cp, pipeline stage), so
  data-parallel replicas and pipeline stages differ while tensor-parallel peers share it. It drives
  every dropout on activations that every tp rank holds whole (the residual and embedding dropout
  without sequence parallelism, MoE router jitter), so the replicas of such an activation stay equal.
- sharded: inside a module whose activations tp splits, a stream seeded from a number drawn from the
  replicated stream and the tp rank, so the shards of a split activation get different masks:
  attention dropout (each rank holds heads/tp heads) and, under sequence parallelism, the residual and
  embedding dropout (each rank holds seq/tp positions; Megatron forks its tracker there too).
The replicated stream is the default generator itself (CPU, and the CUDA device's on a GPU), reseeded
after the model is built (every rank builds the same initial weights from train.seed first); the
sharded one is switched in around the module by a forward pre-hook and switched back after it. Its
seed is drawn from the replicated stream, so activation checkpointing, which restores the default
generator before recomputing, recomputes the same masks. The per-rank generator states are gathered
into the checkpoint's trainer state and each rank restores its own, so a resume draws the same masks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

DROPOUT_RNG_KEY = "dropout_rng"  # its entry in the trainer state


def stream_seed(*key: Any) -> int:
    """A 63-bit seed from a key (the run seed and coordinates): blake2b of the key's text."""
    text = "/".join(str(k) for k in key).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def replica_seed(seed: int, data_rank: int, pp_rank: int = 0) -> int:
    """The seed of the replicated stream of data rank `data_rank` (over dp_replicate x dp_shard x cp) and
    pipeline stage `pp_rank`; tensor-parallel peers share it."""
    return stream_seed(seed, "dropout", data_rank, pp_rank)


def sharded_seed(drawn: int, tp_rank: int) -> int:
    """The seed of a sharded region's stream: `drawn` comes from the replicated stream, so tp peers
    agree on it, and the tp rank makes their streams differ."""
    return stream_seed(drawn, "tp", tp_rank)


class DropoutRNG:
    """The dropout streams of one rank: `data_rank`, `pp_rank`, `tp_rank` and the sizes of those axes."""

    def __init__(self, seed: int, device: torch.device, *, data_rank: int = 0, num_data: int = 1, pp_rank: int = 0,
                 num_pp: int = 1, tp_rank: int = 0, num_tp: int = 1):
        self.seed, self.device = seed, device
        self.coordinates = (data_rank, pp_rank, tp_rank)
        self.layout = (num_data, num_pp, num_tp)
        self.generators = [torch.default_generator]  # CPU: the replicated stream and where sharded seeds come from
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.generators.append(torch.cuda.default_generators[index])

    @property
    def device_generator(self) -> torch.Generator:
        """The generator the device's dropout kernels draw from."""
        return self.generators[-1]

    def reseed(self, step: Optional[int] = None) -> None:
        """Start the replicated stream: from (seed, coordinates), or (seed, coordinates, step) when a
        resume cannot continue the saved streams (another layout, or a checkpoint without them)."""
        data_rank, pp_rank, _ = self.coordinates
        seed = replica_seed(self.seed, data_rank, pp_rank)
        if step is not None:
            seed = stream_seed(seed, "step", step)
        for g in self.generators:
            g.manual_seed(seed)

    @contextmanager
    def sharded(self) -> Iterator[None]:
        """Run the body on this tp rank's own stream; the replicated stream continues afterwards."""
        drawn = int(torch.randint(0, 2**62, (1,), generator=torch.default_generator).item())
        g = self.device_generator
        saved = g.get_state()
        g.manual_seed(sharded_seed(drawn, self.coordinates[2]))
        try:
            yield
        finally:
            g.set_state(saved)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's generator states (a collective under several processes): {"layout", "keys",
        "states"}, rank r's (data, pp, tp) coordinates in keys[r] and its states in states[r]."""
        local = torch.cat([g.get_state() for g in self.generators])
        where = self.device if self.device.type == "cuda" else torch.device("cpu")  # the default group's device
        keys = torch.tensor(self.coordinates, dtype=torch.int64, device=where)
        if dist.is_initialized() and dist.get_world_size() > 1:
            states = [torch.empty_like(local, device=where) for _ in range(dist.get_world_size())]
            dist.all_gather(states, local.to(where))
            all_keys = [torch.empty_like(keys, device=where) for _ in range(dist.get_world_size())]
            dist.all_gather(all_keys, keys.to(where))
            return {"layout": list(self.layout), "keys": [k.cpu().tolist() for k in all_keys],
                    "states": torch.stack([s.cpu() for s in states])}
        return {"layout": list(self.layout), "keys": [keys.tolist()], "states": local[None]}

    def load_state_dict(self, state: Optional[dict[str, Any]], step: int) -> bool:
        """Continue this rank's saved streams; -> False (and reseed from the step) when the checkpoint
        has none for this rank: saved under another parallel layout, or by an older meshtron under
        several processes (in one process the default generator the caller restored from the
        checkpoint's "rng" entry is the stream, so it is kept)."""
        if not state and self.layout == (1, 1, 1):
            return True
        if state and list(state.get("layout", ())) == list(self.layout):
            keys = [tuple(k) for k in state["keys"]]
            if self.coordinates in keys:
                flat = state["states"][keys.index(self.coordinates)]
                sizes = [g.get_state().numel() for g in self.generators]
                if flat.numel() == sum(sizes):
                    for g, part in zip(self.generators, torch.split(flat.to(torch.uint8), sizes)):
                        g.set_state(part.clone())
                    return True
        self.reseed(step)
        return False

    def install(self, parts: list[nn.Module], *, sequence_parallel: bool) -> int:
        """Put the sharded regions of `parts` (GPTModels or pipeline stages of one, after apply_tp) on the
        sharded stream; -> how many modules. Attention mixers always (their heads are split); under
        sequence parallelism also the residual and embedding dropout (their positions are split)."""
        if self.layout[2] == 1:
            return 0
        modules: list[nn.Module] = []
        for part in parts:
            layers = part.layers.values() if isinstance(part.layers, nn.ModuleDict) else part.layers
            for layer in layers:
                if layer.symbol == "*" and getattr(layer.mixer, "dropout", 0.0) > 0:
                    modules.append(layer.mixer)
                if sequence_parallel and layer.dropout.p > 0:
                    modules.append(layer.dropout)
            embedding_dropout = getattr(part, "embedding_dropout", None)
            if sequence_parallel and embedding_dropout is not None and embedding_dropout.p > 0:
                modules.append(embedding_dropout)
        for module in modules:
            _on_sharded_stream(module, self)
        return len(modules)


def _on_sharded_stream(module: nn.Module, rng: DropoutRNG) -> None:
    """Forward hooks that run `module` (in training) inside `rng.sharded()`; the after-hook runs even
    when the forward raises, so the replicated stream is always switched back."""
    stacks: list[Optional[ExitStack]] = []

    @torch.compiler.disable
    def enter(mod: nn.Module, args: Any) -> None:
        stack = None
        if mod.training:
            stack = ExitStack()
            stack.enter_context(rng.sharded())
        stacks.append(stack)

    @torch.compiler.disable
    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        stack = stacks.pop() if stacks else None
        if stack is not None:
            stack.close()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def apply_dropout_rng(parts: list[nn.Module], mesh: Any, seed: int, device: torch.device, *,
                      sequence_parallel: bool = False) -> DropoutRNG:
    """Give this rank its dropout streams: reseed the default generators with the replicated stream
    (call it after the model is built, so every rank built the same weights) and put the sharded
    regions on the sharded stream. `mesh` is the run's mesh (None in a single process)."""
    if mesh is None:
        rng = DropoutRNG(seed, device)
    else:
        data, pp, tp = mesh["dp_cp"], mesh["pp"], mesh["tp"]
        rng = DropoutRNG(seed, device, data_rank=data.get_local_rank(), num_data=data.size(),
                         pp_rank=pp.get_local_rank(), num_pp=pp.size(), tp_rank=tp.get_local_rank(),
                         num_tp=tp.size())
    rng.reseed()
    rng.install(parts, sequence_parallel=sequence_parallel)
    return rng
