"""Distillation under pipeline parallelism, for the logits losses (kl, reverse_kl, topk_kl).

The teacher is split into as many stages as the student (its own pattern cut as evenly as possible,
earlier stages one sublayer longer when it does not divide) and its
stages are placed on the same pp ranks by the same rule, so the teacher's last stage lives on the
rank of the student's last stage. Each step, before the student's schedule, the teacher runs
forward only over the step's micro-batches (stage by stage, pipeline_eval.forward_only, no
gradients) and that rank keeps every micro-batch's whole-vocabulary logits. The student's schedule
then runs with a loss function that, on the last stage, gives micro-batch i's student logits and the
kept teacher logits of micro-batch i to the balancer. The logged terms are summed on the last stage
and broadcast over pp. Hidden-state losses are refused: their layer pairs may sit on different stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.parallel.pipeline import Pipeline, _stage_kwargs
from meshtron.parallel.pipeline_eval import forward_only
from meshtron.parallel.pipeline_stages import build_stage_modules


class PipelinedTeacher:
    """This rank's teacher stages (matching the student pipeline's stage ids) and, after `run`, the
    teacher logits of every micro-batch on the rank that holds the last stage."""

    def __init__(self, teacher: nn.Module, pipeline: Pipeline):
        self.pipeline = pipeline
        ranges = teacher_stage_ranges(len(teacher.cfg.pattern), pipeline.num_stages)
        self.parts = build_stage_modules(teacher, ranges, pipeline.stage_ids)
        for part in self.parts:
            part.eval()
        self.logits: dict[int, torch.Tensor] = {}

    def run(self, batches: list[dict[str, torch.Tensor]], vocabulary_logits: Callable[[torch.Tensor], torch.Tensor],
            autocast) -> None:
        """Forward the teacher over `batches`; keep (whole-vocabulary) logits by micro-batch index."""
        p = self.pipeline
        self.logits = {}

        def keep(logits: torch.Tensor, i: int) -> None:
            self.logits[i] = vocabulary_logits(logits)

        with torch.no_grad(), autocast:
            forward_only(self.parts, p.stage_ids, p.num_stages, p.rank_of, p.group, p.device, batches,
                         _stage_kwargs, keep)


def teacher_stage_ranges(num_sublayers: int, num_stages: int) -> list[range]:
    """Sublayer ranges of the teacher's stages: sizes differ by at most one, longer ones first."""
    if num_sublayers < num_stages:
        raise ConfigError(f"teacher: its {num_sublayers} sublayers do not fill the {num_stages} pipeline stages "
                          "(parallel.pp x parallel.pp_virtual_stages); use fewer stages or a deeper teacher")
    base, extra = divmod(num_sublayers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def broadcast_extras(extras: dict[int, dict[str, tuple[float, float]]], pipeline: Pipeline
                     ) -> dict[str, tuple[float, float]]:
    """{name: (sum, count)} over the step's micro-batches, from the last stage's rank to every pp rank."""
    totals: dict[str, list[float]] = {}
    for per_batch in extras.values():
        for name, (value, count) in per_batch.items():
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + value, acc[1] + count
    box: list[Any] = [totals if pipeline.has_last else None]
    dist.broadcast_object_list(box, group=pipeline.group, group_src=pipeline.rank_of(pipeline.num_stages - 1))
    return {name: (v, c) for name, (v, c) in sorted(box[0].items())}
