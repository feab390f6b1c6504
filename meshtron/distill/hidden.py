"""Hidden states for distillation: forward hooks that keep the output of chosen sublayers (the
residual stream after them), and the learned projections from the student's width to the
teacher's.

Layouts: under tensor parallelism with sequence parallelism a sublayer's output is this rank's
slice of the sequence (a plain local tensor); it is all-gathered along the sequence (with autograd)
so every tensor-parallel rank compares whole sequences, as it does for the logits. Under FSDP,
data parallelism and context parallelism each rank compares its own tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard


def resolve_index(index: int, num_sublayers: int, what: str) -> int:
    from meshtron.config.fields import ConfigError

    resolved = index + num_sublayers if index < 0 else index
    if not 0 <= resolved < num_sublayers:
        raise ConfigError(f"distill.layer_pairs: {what} sublayer {index} is out of range; the {what} has "
                          f"{num_sublayers} sublayers (0..{num_sublayers - 1}, or negative from the end)")
    return resolved


def whole_sequence(h: torch.Tensor, seq_mesh=None) -> torch.Tensor:
    """A sublayer's output as a whole (batch, seq, width) tensor (gathered with autograd if sharded)."""
    if isinstance(h, DTensor):
        return h.full_tensor()
    if seq_mesh is not None:
        return DTensor.from_local(h, seq_mesh, [Shard(1)]).full_tensor()
    return h


class HiddenCapture:
    """Keeps the outputs of `model.layers[i]` for the given indices during each forward."""

    def __init__(self, model: nn.Module, indices: list[int], seq_mesh=None):
        self.indices, self.seq_mesh = indices, seq_mesh   # seq_mesh: the tp mesh under sequence parallelism
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles = [model.layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(indices))]

    def _hook(self, i: int):
        def keep(module, args, output):
            self._outputs[i] = output
        return keep

    def take(self) -> list[torch.Tensor]:
        """The kept outputs in `indices` order, as whole (batch, seq, width) tensors; then forget them."""
        out = [self._whole(self._outputs[i]) for i in self.indices]
        self._outputs = {}
        return out

    def _whole(self, h: torch.Tensor) -> torch.Tensor:
        return whole_sequence(h, self.seq_mesh)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class DistillProjections(nn.Module):
    """One bias-free linear map per layer pair from the student's width to the teacher's (identity
    when they are equal). It is attached to the student as `distill_projections`, so it is sharded,
    optimized and checkpointed with it; plain model loading ignores it. Maps are keyed by the pair's
    index ("maps.<j>"), so under pipeline parallelism each stage holds the maps of its own pairs
    (`subset`) under the single-process names."""

    def __init__(self, student_width: int, teacher_width: int, num_pairs: int, std: float):
        super().__init__()
        self.maps = nn.ModuleDict({
            str(j): nn.Linear(student_width, teacher_width, bias=False) if student_width != teacher_width
            else nn.Identity() for j in range(num_pairs)})
        for m in self.maps.values():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)

    def subset(self, pairs: list[int]) -> DistillProjections:
        """A module holding (sharing) the maps of `pairs` only."""
        part = DistillProjections.__new__(DistillProjections)
        nn.Module.__init__(part)
        part.maps = nn.ModuleDict({str(j): self.maps[str(j)] for j in pairs})
        return part

    def forward(self, hidden: list[torch.Tensor], pairs: list[int] | None = None) -> list[torch.Tensor]:
        """Projected `hidden` states of the layer pairs `pairs` (default: every pair, in order)."""
        keys = range(len(hidden)) if pairs is None else pairs
        return [self.maps[str(j)](h) for j, h in zip(keys, hidden)]
