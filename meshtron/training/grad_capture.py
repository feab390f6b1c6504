"""Gradient capture (`--save-wgrads DIR`, `--save-dgrads DIR`, every `grads.interval` steps): the
gradients of every nn.Linear and nn.Embedding layer, of the MoE routed experts (GroupedExperts: the
stacked 3-D w_gate/w_up/w_down and their biases) and of the MoE routers' weights, saved for
comparing two runs.

- wgrads: each such layer's weight (and bias) gradient after the whole global batch's backward,
  before clipping: the gradient of the loss (mean over the global batch's loss tokens).
- dgrads: each layer's own input gradient (`NAME.input`; not for embeddings, whose input is token
  ids) and output gradient (`NAME.output`), concatenated over the micro-batches along the batch.
  Routers give weight gradients only (their output is a tuple of probabilities and indices). The
  experts' activations are their (rows, hidden) inputs and outputs, rows grouped by expert within
  each micro-batch.

Saved gathered, so runs with different layouts compare tensor by tensor: a DTensor gradient (TP,
FSDP, EP, any mix) is gathered to the full tensor (all experts, full width), and activation
gradients are concatenated over the data-parallel ranks in rank order, which is the global batch
order (rank r holds the r-th block of every global batch). Under expert parallelism the experts'
activation rows on a rank are the tokens other ranks routed to its experts, so their gathered
gradients hold the same rows as one process's but in another order (ranks may also hold different
numbers of rows): compare those by value sets, not row by row. Rank 0 writes DIR/step_XXXXXXXX.pt ({name: tensor} on the CPU) and
DIR/meta.json (depth, precision, layout). Pipeline parallelism is not supported; activation
gradients also not under context parallelism (each rank holds a zig-zag part of the sequence).

A layer's input gradient is its own contribution (the input is replaced by an alias whose gradient
is hooked), not the total gradient of a tensor that several layers read.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.config.fields import ConfigError
from meshtron.config.schema import RunConfig
from meshtron.nn.moe.experts import GroupedExperts
from meshtron.nn.moe.router import TopKRouter

CAPTURED = (nn.Linear, nn.Embedding, GroupedExperts, TopKRouter)
# routers return (probs, indices, aux_loss): weight gradients only
WEIGHTS_ONLY = (TopKRouter,)
META_FILE = "meta.json"


def step_file(step: int) -> str:
    return f"step_{step:08d}.pt"


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class GradCapture:
    def __init__(self, parts: list[nn.Module], cfg: RunConfig, dims, dp_group=None, rank: int = 0):
        g = cfg.grads
        if dims.pp > 1:
            raise ConfigError("grads.save_wgrads: gradient capture does not support parallel.pp > 1; "
                              "capture with pp 1 (any TP/FSDP layout)")
        if g.save_dgrads and dims.cp > 1:
            raise ConfigError("grads.save_dgrads: activation gradients are not captured under parallel.cp > 1; "
                              "capture weight gradients only (grads.save_wgrads) or set cp 1")
        self.wgrads_dir = Path(g.save_wgrads) if g.save_wgrads else None
        self.dgrads_dir = Path(g.save_dgrads) if g.save_dgrads else None
        self.interval, self.dp_group, self.rank = g.interval, dp_group, rank
        self.meta = {"num_layers": len(cfg.model.pattern), "precision": cfg.train.precision,
                     "world_size": dims.world_size, "layout": {"dp_replicate": dims.dp_replicate,
                     "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp, "pp": dims.pp}}
        self.modules = [(name, m) for part in parts for name, m in part.named_modules() if isinstance(m, CAPTURED)]
        self.active = False
        self.step = 0
        self._dgrads: dict[str, list[torch.Tensor]] = {}
        if self.dgrads_dir is not None:
            for name, module in self.modules:
                if isinstance(module, WEIGHTS_ONLY):
                    continue
                module.register_forward_pre_hook(partial(self._hook_input, name))
                # before the tensor-parallel output hooks, so a sharded output is still a DTensor here
                module.register_forward_hook(partial(self._hook_output, name), prepend=True)

    def begin(self, step: int) -> None:
        """Called before step `step`'s forward passes: capture when it falls on the interval."""
        self.step, self.active = step, step % self.interval == 0
        self._dgrads = {}

    def _hooked_alias(self, key: str, x: Any) -> Optional[torch.Tensor]:
        if not (self.active and torch.is_grad_enabled() and torch.is_tensor(x) and x.requires_grad):
            return None
        alias = x.view_as(x)
        alias.register_hook(lambda grad: self._dgrads.setdefault(key, []).append(grad.detach()))
        return alias

    def _hook_input(self, name: str, module: nn.Module, args: tuple) -> Optional[tuple]:
        alias = self._hooked_alias(f"{name}.input", args[0]) if args else None
        return None if alias is None else (alias, *args[1:])

    def _hook_output(self, name: str, module: nn.Module, args: tuple, output: Any) -> Optional[torch.Tensor]:
        return self._hooked_alias(f"{name}.output", output)

    def save(self) -> None:
        """Called after the backward passes of the step, before clipping: gather and write."""
        if not self.active:
            return
        self.active = False
        if self.wgrads_dir is not None:
            grads = {}
            for name, module in self.modules:
                for pname, p in module.named_parameters(recurse=False):
                    if p.grad is not None:
                        grads[f"{name}.{pname}"] = _full(p.grad).detach().to("cpu", copy=True)
            self._write(self.wgrads_dir, grads)
        if self.dgrads_dir is not None:
            grads = {key: self._gather_dp(torch.cat([_full(g) for g in self._dgrads[key]], dim=0))
                     for key in sorted(self._dgrads)}
            self._dgrads = {}
            self._write(self.dgrads_dir, grads)

    def _gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate this rank's (batch, ...) gradient with the other data-parallel ranks', in rank order."""
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return t.detach().to("cpu", copy=True)
        # rows may differ per rank (the tokens routed to a rank's experts): pad to the largest
        size = torch.tensor([t.shape[0]], device=t.device)
        sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(self.dp_group))]
        dist.all_gather(sizes, size, group=self.dp_group)
        rows = [int(n) for n in sizes]
        padded = t.detach().new_zeros(max(rows), *t.shape[1:])
        padded[:t.shape[0]] = t.detach()
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded, group=self.dp_group)
        return torch.cat([part[:n] for part, n in zip(parts, rows)], dim=0).cpu()

    def _write(self, directory: Path, grads: dict[str, torch.Tensor]) -> None:
        if self.rank != 0:
            return
        directory.mkdir(parents=True, exist_ok=True)
        (directory / META_FILE).write_text(json.dumps(self.meta, indent=2) + "\n")
        tmp = directory / (step_file(self.step) + ".tmp")
        torch.save(grads, tmp)
        tmp.replace(directory / step_file(self.step))


# ---- reading captures back ------------------------------------------------------------------------

def captured_steps(directory: str | Path) -> list[int]:
    return sorted(int(p.name[5:13]) for p in Path(directory).glob("step_*.pt"))


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise ValueError(f"{str(directory)!r} holds no gradient capture ({META_FILE} missing); "
                         "give a directory written by --save-wgrads or --save-dgrads")
    return json.loads(path.read_text())


def load_grads(directory: str | Path, step: Optional[int] = None) -> dict[str, torch.Tensor]:
    """{name: full gradient} of one captured step (default: the last one)."""
    steps = captured_steps(directory)
    if not steps:
        raise ValueError(f"{str(directory)!r} holds no captured step (step_XXXXXXXX.pt)")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"{str(directory)!r} has no capture of step {step}; it has steps {steps}")
    return torch.load(Path(directory) / step_file(step), weights_only=True)
