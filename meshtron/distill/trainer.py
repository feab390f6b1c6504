"""Knowledge distillation on the ordinary training loop: `DistillTrainer` is the `Trainer` with a
frozen teacher and a different objective. Data, accumulation, parallel layouts, clipping,
optimizer, checkpoints and logging are the trainer's own.

Per local micro-batch: the teacher runs without gradients on the same tokens and context; the
student runs as usual; both expose full-vocabulary logits (gathered under tensor parallelism and
cut to the tokenizer's vocabulary) and, when a loss needs them, the hidden states of the chosen
layer pairs (the student's projected to the teacher's width); the balancer sums the weighted
losses over the loss tokens. Evaluation reports the student's own loss on the labels.

The teacher is parallelized like the student (same mesh and plans: TP, FSDP, CP, EP). Under pipeline
parallelism the teacher is split into the student's number of stages and runs forward first; the
logits losses are computed in the student's last stage, each hidden-state pair's term on the stage
holding its student sublayer (distill/pipeline.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.config.fields import ConfigError
from meshtron.config.schema import RunConfig
from meshtron.distill.balancer import LossBalancer
from meshtron.distill.hidden import DistillProjections, HiddenCapture, resolve_index
from meshtron.distill.losses import ModelOutputs, build_losses
from meshtron.distill.pipeline import (
    PipelinedHiddenLosses,
    PipelinedTeacher,
    check_pair_stages,
    gather_extras,
    teacher_stage_ranges,
)
from meshtron.distill.teacher import build_teacher, teacher_model_config
from meshtron.models.gpt import GPTModel
from meshtron.models.mtp import combine_losses, forward_for_loss
from meshtron.nn.loss import masked_cross_entropy
from meshtron.parallel import fsdp_mesh, parallelize_parts
from meshtron.parallel.fsdp import apply_fsdp_unit
from meshtron.parallel.parts import ModelParts
from meshtron.parallel.pipeline_stages import split_layers
from meshtron.training.metrics import MetricsLogger
from meshtron.training.trainer import StepResult, Trainer


class DistillTrainer(Trainer):
    def __init__(self, cfg: RunConfig, echo: bool = True):
        self.balancer = LossBalancer(build_losses(cfg.distill), cfg.distill.loss_weights(), cfg.distill.label_weight)
        # under pipeline parallelism the last stage computes the logits losses, other stages the hidden ones
        hidden = {n for n, loss in self.balancer.losses.items() if getattr(loss, "needs_hidden", False)}
        self.logits_balancer = LossBalancer({n: v for n, v in self.balancer.losses.items() if n not in hidden},
                                            {n: w for n, w in self.balancer.weights.items() if n not in hidden},
                                            cfg.distill.label_weight)
        self.hidden_losses = {n: self.balancer.losses[n] for n in hidden}
        self.pipelined_teacher = self.pipelined_hidden = None
        self._pipeline_extras: dict[int, dict[str, tuple[float, float]]] = {}
        self.teacher_cfg = teacher_model_config(cfg)
        self.layer_pairs: list[tuple[int, int]] = []
        super().__init__(cfg, echo)
        with self.timers.startup_phase("teacher"):
            self._build_teacher()

    def extend_model(self, model: GPTModel) -> None:
        """Resolve the layer pairs and attach the student-to-teacher projections (own FSDP unit)."""
        if not self.balancer.needs_hidden:
            return
        num_student, num_teacher = len(model.cfg.pattern), len(self.teacher_cfg.pattern)
        self.layer_pairs = [(resolve_index(s, num_student, "student"), resolve_index(t, num_teacher, "teacher"))
                            for s, t in self.cfg.distill.parsed_layer_pairs()]
        if not self.layer_pairs:
            raise ConfigError("distill.layer_pairs: the hidden-state losses need at least one 'student:teacher' pair")
        if self.dims.pp > 1:
            check_pair_stages(self.cfg, self.layer_pairs)
        width = model.cfg.hidden_size
        model.distill_projections = DistillProjections(width, self.teacher_cfg.hidden_size, len(self.layer_pairs),
                                                       std=width ** -0.5).to(self.device)
        self._projections = model.distill_projections
        if self.dims.pp == 1:
            self._shard_projections(model.distill_projections)

    def extend_stages(self, parts: list[nn.Module]) -> None:
        """Pipeline parallelism: each stage holds the projections of the pairs whose student sublayer it runs."""
        if not self.layer_pairs:
            return
        for part in parts:
            here = [j for j, (s, _) in enumerate(self.layer_pairs) if str(s) in part.layers]
            if here:
                part.distill_projections = self._projections.subset(here)
                self._shard_projections(part.distill_projections)

    def _shard_projections(self, projections: nn.Module) -> None:
        if self.dims.fsdp_enabled and any(True for _ in projections.parameters()):
            apply_fsdp_unit(projections, fsdp_mesh(self.mesh, self.dims),
                            param_dtype=torch.bfloat16 if self.cfg.train.precision == "bf16" else None)

    def _build_teacher(self) -> None:
        cfg = self.cfg
        teacher = build_teacher(cfg, self.teacher_cfg, self.tokenizer.vocab_size, self.device)
        plain = dataclasses.replace(cfg.parallel, activation_checkpoint="none")
        parts = [teacher]
        if self.pipeline is not None:
            self.pipelined_teacher = PipelinedTeacher(teacher, self.pipeline)
            parts = self.pipelined_teacher.parts
            teacher = ModelParts(parts)
            # the last stage's loss becomes the distillation objective (evaluation keeps the plain one)
            self.pipeline.objective = self._pipeline_loss
        try:
            parallelize_parts(parts, self.dims, self.mesh, dataclasses.replace(cfg, model=self.teacher_cfg,
                                                                               parallel=plain))
        except ConfigError as e:
            raise ConfigError(f"teacher: {e}") from None
        self.teacher = teacher
        seq_mesh = self.mesh["tp"] if self.dims.tp > 1 and cfg.parallel.sequence_parallel else None
        self.student_hidden = self.teacher_hidden = None
        if self.layer_pairs and self.pipeline is not None:
            student_ranges = split_layers(len(cfg.model.pattern), self.pipeline.num_stages,
                                          cfg.parallel.pp_first_stage_sublayers, cfg.parallel.pp_last_stage_sublayers)
            teacher_ranges = teacher_stage_ranges(len(self.teacher_cfg.pattern), self.pipeline.num_stages)
            self.pipelined_hidden = PipelinedHiddenLosses(
                self.pipeline, self.model_parts, parts, self.layer_pairs, student_ranges, teacher_ranges,
                self.hidden_losses, self.balancer.weights, self.teacher_cfg.hidden_size, seq_mesh)
            self.pipeline.stage_loss_sum = lambda: self.pipelined_hidden.loss_sum
        elif self.layer_pairs:
            self.student_hidden = HiddenCapture(self.model, [s for s, _ in self.layer_pairs], seq_mesh)
            self.teacher_hidden = HiddenCapture(teacher, [t for _, t in self.layer_pairs], seq_mesh)

    def _vocabulary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary logits (gathered if vocabulary-sharded), cut to the tokenizer's ids."""
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return logits[..., : self.tokenizer.vocab_size]

    def _forward_loss(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        if not self.model.training:
            return super()._forward_loss(mb)   # evaluation: the student's own loss on the labels
        with torch.no_grad(), self._autocast():
            teacher_logits = self.teacher(mb["input_ids"], self._context(mb))
        teacher = ModelOutputs(self._vocabulary_logits(teacher_logits),
                               self.teacher_hidden.take() if self.teacher_hidden else [])
        with self._autocast():
            logits, mtp_logits = forward_for_loss(self.model, mb["input_ids"], self._context(mb))
            hidden = self.model.distill_projections(self.student_hidden.take()) if self.student_hidden else []
        student = ModelOutputs(self._vocabulary_logits(logits), hidden)
        cross_entropy = masked_cross_entropy
        if self.dims.tp > 1 and self.cfg.parallel.loss_parallel:
            from meshtron.parallel.loss import vocab_parallel_cross_entropy as cross_entropy
        label_loss = combine_losses(logits, mtp_logits, mb["labels"], mb["loss_mask"], mb.get("document_ids"),
                                    self.cfg.model, cross_entropy)
        return self.balancer(student, teacher, mb["loss_mask"], label_loss)

    # ---- pipeline parallelism -----------------------------------------------------------------

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        if self.pipelined_teacher is None:
            return super().train_step(micro_batches)
        local = [self._local_micro_batch(mb) for mb in micro_batches]
        hidden = self.pipelined_hidden
        if hidden is not None:
            hidden.begin()
        with self._phase("teacher", " forward (pipelined)"):
            self.pipelined_teacher.run(local, self._vocabulary_logits, self._autocast())
            if hidden is not None:
                hidden.exchange(local)
        self._pipeline_extras = {}
        result = super().train_step(micro_batches)
        kept = [self._pipeline_extras] + ([hidden.extras] if hidden is not None else [])
        for name, (value, count) in gather_extras(kept, self.pipeline).items():
            result.extra[name] = self._global_sum(value) / max(self._global_sum(count), 1.0)
        if hidden is not None:
            hidden.end(len(micro_batches))
            hidden.begin()
        self._pipeline_extras, self.pipelined_teacher.logits = {}, {}
        return result

    def _pipeline_loss(self, logits: torch.Tensor, mb: dict[str, torch.Tensor], i: int) -> torch.Tensor:
        """The pipeline's objective: the last stage's weighted distillation loss of micro-batch i (unscaled)."""
        p = self.pipeline
        if not self.model_parts[0].training or i not in self.pipelined_teacher.logits:
            return p.cross_entropy(logits, mb, i)   # evaluation: the student's own loss on the labels
        cross_entropy = masked_cross_entropy
        if p.loss_parallel:
            from meshtron.parallel.loss import vocab_parallel_cross_entropy as cross_entropy
        label_loss = combine_losses(logits, [], mb["labels"], mb["loss_mask"], mb.get("document_ids"),
                                    self.cfg.model, cross_entropy)
        student = ModelOutputs(self._vocabulary_logits(logits), [])
        teacher = ModelOutputs(self.pipelined_teacher.logits[i], [])
        loss, num_tokens, extras = self.logits_balancer(student, teacher, mb["loss_mask"], label_loss)
        for name in self.hidden_losses:   # the value is summed from the stages holding the pairs
            extras[f"distill_{name}"] = (torch.zeros(()), num_tokens)
        # keyed by micro-batch: the stage's shape inference calls this once for index 0 before the real call
        self._pipeline_extras[i] = {name: (float(v), float(c)) for name, (v, c) in extras.items()}
        return loss

    def _announce(self, logger: MetricsLogger) -> None:
        super()._announce(logger)
        t = self.teacher_cfg
        weights = ", ".join(f"{n} {w:g}" for n, w in self.balancer.weights.items())
        logger.message(f"teacher: {self.cfg.teacher.load} | pattern '{t.pattern}', width {t.hidden_size} | "
                       f"losses: {weights}, labels {self.balancer.label_weight:g}"
                       + (f" | layer pairs {self.layer_pairs}" if self.layer_pairs else ""))
