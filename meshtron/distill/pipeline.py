"""Distillation under pipeline parallelism, for the logits losses (kl, reverse_kl, topk_kl).

The teacher is split into as many stages as the student (its own pattern cut as evenly as possible,
earlier stages one sublayer longer when it does not divide) and its
stages are placed on the same pp ranks by the same rule, so the teacher's last stage lives on the
rank of the student's last stage. Each step, before the student's schedule, the teacher runs
forward only over the step's micro-batches (stage by stage, pipeline_eval.forward_only, no
gradients) and that rank keeps every micro-batch's whole-vocabulary logits. The student's schedule
then runs with a loss function that, on the last stage, gives micro-batch i's student logits and the
kept teacher logits of micro-batch i to the balancer (its logits losses and the labels).

Hidden-state losses (`PipelinedHiddenLosses`): a layer pair's student sublayer and teacher sublayer
may sit on different stages. Hooks on the teacher's stages keep the chosen sublayers' outputs during
its forward; after it, each one is sent (point to point over pp) to the rank of the stage holding the
pair's student sublayer. That stage holds the pair's projection (`extend_stages` puts it there, so it
is in that rank's optimizer) and a forward hook on the student sublayer computes the pair's term,
weight * (1/J) * loss(P_j h_s, h_t) * (1 / tokens of the step), and attaches it to the sublayer's
output with `_AddLoss`: an identity whose backward also back-propagates the term, so it joins the
stage's backward (the schedule calls the loss function on the last stage only). A hidden loss is
thus evaluated pair by pair and averaged over the J pairs, as the built-in ones are defined. The
hooks read the micro-batch index of the stage forward running from the schedule.
The logged terms are summed over the pp ranks; the hidden terms are added to the step's loss sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.distill.hidden import whole_sequence
from meshtron.distill.losses import DistillLoss, ModelOutputs
from meshtron.parallel.pipeline import Pipeline
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
            # under context parallelism the teacher's stages see this cp rank's tokens, like the student's:
            # ring attention over cp and global positions (the pipeline's own stage inputs)
            part.context_parallel = pipeline.context_parallel
        self.logits: dict[int, torch.Tensor] = {}

    def run(self, batches: list[dict[str, torch.Tensor]], vocabulary_logits: Callable[[torch.Tensor], torch.Tensor],
            autocast) -> None:
        """Forward the teacher over `batches`; keep (whole-vocabulary) logits by micro-batch index."""
        p = self.pipeline
        self.logits = {}

        def keep(logits: torch.Tensor, i: int) -> None:
            self.logits[i] = vocabulary_logits(logits)

        with torch.no_grad(), autocast:
            p.forward_only(self.parts, batches, keep)


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


def gather_extras(extras: list[dict[int, dict[str, tuple[float, float]]]], pipeline: Pipeline
                  ) -> dict[str, tuple[float, float]]:
    """{name: (sum, count)} over the step's micro-batches and every pp rank's logged terms, on every pp rank."""
    totals: dict[str, list[float]] = {}
    for per_batch in (entry for kept in extras for entry in kept.values()):
        for name, (value, count) in per_batch.items():
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + value, acc[1] + count
    gathered: list[Any] = [None] * dist.get_world_size(pipeline.group)
    dist.all_gather_object(gathered, totals, group=pipeline.group)
    merged: dict[str, list[float]] = {}
    for part in gathered:
        for name, (value, count) in part.items():
            acc = merged.setdefault(name, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + value, acc[1] + count
    return {name: (v, c) for name, (v, c) in sorted(merged.items())}


def check_pair_stages(cfg, pairs: list[tuple[int, int]]) -> None:
    """Refuse layer pairs whose student sublayers fall in two different stages of one pp rank (with
    virtual stages): that placement gives wrong gradients in the earlier stage (found by the parity
    test, cause not yet identified), so it is refused rather than run."""
    from meshtron.parallel.pipeline import schedule_class
    from meshtron.parallel.pipeline_stages import rank_of_stage, split_layers

    p = cfg.parallel
    num_stages = p.pp * p.pp_virtual_stages
    ranges = split_layers(len(cfg.model.pattern), num_stages, p.pp_first_stage_sublayers, p.pp_last_stage_sublayers)
    _, style = schedule_class(p.pp_schedule, p.pp_virtual_stages)
    held: dict[int, dict[int, int]] = {}   # pp rank -> {stage: a student sublayer in it}
    for s, _ in pairs:
        stage = stage_of(s, ranges)
        held.setdefault(rank_of_stage(stage, p.pp, num_stages, style), {})[stage] = s
    for rank, stages in sorted(held.items()):
        if len(stages) > 1:
            (a, sa), (b, sb) = sorted(stages.items())[:2]
            raise ConfigError(f"distill.layer_pairs: student sublayers {sa} and {sb} lie in pipeline stages {a} and "
                              f"{b}, both on pp rank {rank}; hidden-state losses support one such stage per pp rank: "
                              "choose pairs whose student sublayers sit on stages of different ranks, or use "
                              "parallel.pp_virtual_stages 1")


def stage_of(index: int, ranges: list[range]) -> int:
    return next(s for s, r in enumerate(ranges) if index in r)


class _AddLoss(torch.autograd.Function):
    """Identity on `output`; its backward also back-propagates the scalar `loss` (gradient 1), so a
    loss computed inside a pipeline stage joins that stage's backward."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return output.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)


class PipelinedHiddenLosses:
    """The hidden-state terms under pipeline parallelism (see the module docstring).

    pairs: (student sublayer, teacher sublayer) per layer pair j; losses/weights: the hidden losses.
    Per step: `begin()`, the teacher's forward (its hooks keep the hidden states), `exchange(batches)`,
    then the student's schedule (its hooks add the terms). `loss_sum` and `extras` hold this rank's
    part of the step's weighted hidden terms and logged values."""

    def __init__(self, pipeline: Pipeline, student_parts: list[nn.Module], teacher_parts: list[nn.Module],
                 pairs: list[tuple[int, int]], student_ranges: list[range], teacher_ranges: list[range],
                 losses: dict[str, DistillLoss], weights: dict[str, float], teacher_width: int, seq_mesh=None):
        self.pipeline, self.pairs, self.losses, self.weights = pipeline, pairs, losses, weights
        self.teacher_width, self.seq_mesh = teacher_width, seq_mesh
        self.student_stage = [stage_of(s, student_ranges) for s, _ in pairs]
        self.teacher_stage = [stage_of(t, teacher_ranges) for _, t in pairs]
        self._teacher_out: dict[int, list[torch.Tensor]] = {}
        self._handles = []
        for part in teacher_parts:
            for t in sorted({t for _, t in pairs}):
                if str(t) in part.layers:
                    self._handles.append(part.layers[str(t)].register_forward_hook(self._keep_teacher(t)))
        for part in student_parts:
            for s in sorted({s for s, _ in pairs}):
                if str(s) in part.layers:
                    here = [j for j, (sj, _) in enumerate(pairs) if sj == s]
                    self._handles.append(part.layers[str(s)].register_forward_hook(self._add_terms(part, s, here)))
        self.teacher_hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.begin()

    def begin(self) -> None:
        self._teacher_out = {t: [] for _, t in self.pairs}
        self._seen: dict[int, set[int]] = {s: set() for s, _ in self.pairs}
        self.teacher_hidden = {}
        self.loss_sum = 0.0
        self.extras: dict[int, dict[str, tuple[float, float]]] = {}

    def _keep_teacher(self, t: int):
        def keep(module, args, output):
            self._teacher_out[t].append(whole_sequence(output, self.seq_mesh).float())
        return keep

    def exchange(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """Move each pair's teacher hidden states to the rank of its student sublayer's stage."""
        p = self.pipeline
        me = dist.get_rank(p.group)
        for i, mb in enumerate(batches):
            for j, (_, t) in enumerate(self.pairs):
                src, dst = p.rank_of(self.teacher_stage[j]), p.rank_of(self.student_stage[j])
                if me == src:
                    h = self._teacher_out[t][i]
                    if dst == me:
                        self.teacher_hidden[(j, i)] = h
                    else:
                        dist.send(h.contiguous(), group_dst=dst, group=p.group)
                elif me == dst:
                    h = torch.empty(*mb["input_ids"].shape, self.teacher_width, dtype=torch.float32, device=p.device)
                    dist.recv(h, group_src=src, group=p.group)
                    self.teacher_hidden[(j, i)] = h
        self._teacher_out = {t: [] for _, t in self.pairs}

    def _add_terms(self, part: nn.Module, s: int, here: list[int]):
        def add(module, args, output):
            p = self.pipeline
            i = p.micro_batch_of(part) if module.training and torch.is_grad_enabled() else None
            if i is None:
                return None   # evaluation, or the stage's metadata inference (not a micro-batch's forward)
            self._seen[s].add(i)
            mask = p.batches[i]["loss_mask"]
            hidden = whole_sequence(output, self.seq_mesh)
            projected = part.distill_projections([hidden] * len(here), here)
            total = torch.zeros((), dtype=torch.float32, device=mask.device)
            terms = self.extras.setdefault(i, {})
            for name, loss in self.losses.items():
                for j, h in zip(here, projected):
                    value, count, _ = loss(ModelOutputs(None, [h]), ModelOutputs(None, [self.teacher_hidden[(j, i)]]),
                                           mask)
                    share = value / len(self.pairs)
                    if self.weights[name] > 0:
                        total = total + self.weights[name] * share
                    terms[f"distill_{name}_pair{j}"] = (float(value), float(count))
                    acc = terms.get(f"distill_{name}", (0.0, 0.0))
                    terms[f"distill_{name}"] = (acc[0] + float(share), acc[1])
            self.loss_sum += float(total)
            return _AddLoss.apply(output, total * p.loss_scale)
        return add

    def end(self, num_micro_batches: int) -> None:
        assert all(seen in (set(), set(range(num_micro_batches))) for seen in self._seen.values()), \
            "a stage's hidden-loss hook missed a micro-batch"
        self.teacher_hidden = {}
