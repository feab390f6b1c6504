"""Pipeline stages: the layer pattern split into `pp x virtual` contiguous chunks, which chunk runs
on which pipeline rank, and the stage module that runs one chunk.

Split: stage s owns sublayers [start_s, start_s + n_s) of the pattern. Without overrides every
n_s = L / S (S = pp * virtual stages). `pp_first_stage_sublayers` / `pp_last_stage_sublayers` fix
n_0 / n_{S-1} (the first stage also embeds, the last one also runs the head and the loss, so they
are often given fewer sublayers); the others share the rest evenly.

Placement (which pipeline rank runs stage s): "loop" puts s on rank s mod pp (GPipe, 1F1B and the
interleaved schedules); "v" runs down the ranks and back up, so rank r holds stages r and
2*pp - 1 - r (ZB-V), and the first and last stage share rank 0.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Optional

import torch
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.nn.context import PackedContext

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


def split_layers(num_sublayers: int, num_stages: int, first: Optional[int] = None,
                 last: Optional[int] = None) -> list[range]:
    """Sublayer index ranges of the `num_stages` stages, in stage order (every stage gets >= 1)."""
    fixed = {0: first, num_stages - 1: last}
    fixed = {s: n for s, n in fixed.items() if n is not None}
    num_free = num_stages - len(fixed)
    rest = num_sublayers - sum(fixed.values())
    where = (f"the pattern's {num_sublayers} sublayers do not split into {num_stages} pipeline stages "
             f"(parallel.pp x parallel.pp_virtual_stages)")
    if num_free == 0 and rest != 0:
        raise ConfigError(f"parallel.pp_first_stage_sublayers/pp_last_stage_sublayers: {where}: first + last must "
                          f"equal {num_sublayers} with 2 stages; change them")
    if num_free > 0 and (rest < num_free or rest % num_free):
        hint = ("change pp_first_stage_sublayers/pp_last_stage_sublayers so the rest divides evenly"
                if fixed else "set parallel.pp_first_stage_sublayers/pp_last_stage_sublayers or change pp, "
                "pp_virtual_stages or the model's layers")
        raise ConfigError(f"parallel.pp: {where}: {rest} sublayers left for {num_free} stages; {hint}")
    sizes = [fixed.get(s, rest // num_free if num_free else 0) for s in range(num_stages)]
    ranges, start = [], 0
    for n in sizes:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def stages_of_rank(pp_rank: int, pp: int, num_stages: int, style: str) -> list[int]:
    """Stage indices run by `pp_rank`, ascending."""
    if style == "loop":
        return list(range(pp_rank, num_stages, pp))
    assert style == "v" and num_stages == 2 * pp, "the V placement holds exactly two stages per rank"
    return [pp_rank, num_stages - 1 - pp_rank]


def rank_of_stage(stage: int, pp: int, num_stages: int, style: str) -> int:
    return next(r for r in range(pp) if stage in stages_of_rank(r, pp, num_stages, style))


class PipelineStageModule(nn.Module):
    """One pipeline stage of a GPTModel: the sublayers of its chunk (keyed by their global index, so
    parameter names are the single-process ones), plus the embedding on the first stage and the
    final norm and output head on the last. Every stage gets the token positions (and document ids
    of packed samples) as keyword inputs, so RoPE and document masks are right on every stage.

    forward(x, positions, document_ids=None, micro_batch=None):
        first stage: x = tokens (batch, seq) long; otherwise x = hidden (batch, seq, hidden), where seq is
        this cp rank's tokens under context parallelism and their 1/tp part under sequence parallelism
        returns hidden states, or logits (batch, seq, vocab) on the last stage. `micro_batch`: the index
        of the micro-batch in a training schedule (a one-element tensor), kept as `self.micro_batch` for
        hooks inside the stage (`Pipeline.micro_batch_of`); None elsewhere.
    """

    def __init__(self, model: nn.Module, layer_ids: range, is_first: bool, is_last: bool):
        super().__init__()
        self.cfg, self.vocab_size = model.cfg, model.vocab_size
        self.embedding = model.embedding if is_first else None
        self.position_embedding = model.position_embedding if is_first else None
        self.embedding_dropout = model.embedding_dropout if is_first else None
        # rotary holds only a non-persistent buffer: each stage gets its own copy, so that no module
        # is shared by two stages (two FSDP roots on one rank under interleaving)
        self.rotary = copy.deepcopy(model.rotary)
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.final_norm = model.final_norm if is_last else None
        self.output = model.output if is_last else None
        self.is_first, self.is_last = is_first, is_last
        # tied embeddings: the last stage keeps its own copy of the embedding (same name and initial
        # values) for the head; the pipeline sums the two copies' gradients before every optimizer
        # step, so they stay equal (Megatron's tied-embedding all-reduce over the first/last pair)
        self.tied_copy = is_last and not is_first and model.output is None
        if self.tied_copy:
            # the weight is cloned, not deep-copied: a clone of a fake tensor (meshtron plan) stays in its mode
            weight = model.embedding.weight
            fresh = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
            self.embedding = copy.deepcopy(model.embedding, memo={id(weight): fresh})
        # context parallel (set by the pipeline when parallel.cp > 1): the stage's tokens are this cp
        # rank's part of the sequence and its attention is ring attention over cp
        self.context_parallel = None
        # `annotate(name)`: a context manager around the stage's forward (the trainer's profiler / NVTX ranges)
        self.annotate: Callable[[str], AbstractContextManager] = lambda name: nullcontext()
        self.micro_batch: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, document_ids: Optional[torch.Tensor] = None,
                micro_batch: Optional[torch.Tensor] = None) -> torch.Tensor:
        self.micro_batch = micro_batch
        with self.annotate("forward"):
            if self.context_parallel is not None:
                ctx = self.context_parallel.context_for(positions, document_ids)
            else:
                ctx = PackedContext(positions=positions, document_ids=document_ids)
            h = self.embed(x, positions) if self.is_first else x
            if self.rotary is not None:
                ctx.rope = self.rotary(positions)
            for layer in self.layers.values():
                h = layer(h, ctx)
            if self.is_last:
                return self.head(self.final_norm(h))
            return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Normalised hidden states -> logits; the tied head multiplies by the embedding (TP replaces
        this method with the vocab-parallel version, parallel/tensor_parallel.py)."""
        if self.output is None:
            return nn.functional.linear(h, self.embedding.weight)
        return self.output(h)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        if self.position_embedding is not None:
            h = h + self.position_embedding(positions)
        return self.embedding_dropout(h)


def build_stage_modules(model: nn.Module, ranges: list[range], stage_ids: list[int]) -> list[PipelineStageModule]:
    """The stage modules of `stage_ids`, sharing parameters with `model` (which is then discarded)."""
    last = len(ranges) - 1
    return [PipelineStageModule(model, ranges[s], s == 0, s == last) for s in stage_ids]
