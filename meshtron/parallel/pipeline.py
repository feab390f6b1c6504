"""Pipeline parallelism over the `pp` mesh axis with `torch.distributed.pipelining` schedules.

The layer pattern is split into S = pp x pp_virtual_stages stages (pipeline_stages.py). Each step's
m micro-batches flow through them: stage s receives hidden states of micro-batch i from stage s-1,
runs its sublayers, sends the result on; the last stage computes the loss, and gradients of the
hidden states flow back the same way. The schedule decides the order of these forwards (F) and
backwards (B, or I + W when zero-bubble splits input and weight gradients):
    gpipe             all F, then all B (bubble (pp-1)/m, every activation held at once)
    1f1b              pp-rank warm-up of F, then alternate one F and one B (same bubble, fewer activations)
    interleaved_1f1b  v > 1 chunks per rank, placed round-robin: bubble (pp-1)/(v*m)
    zero_bubble       B split into I (input gradient, on the critical path) and W (weight gradient,
                      fills the bubbles): ZB-V with 2 chunks per rank in a V, else interleaved ZB1P
Evaluation runs forward only, stage by stage (pipeline_eval.py), for any placement and count.
Loss: the last stage returns per-micro-batch (sum of token losses) / (global number of loss tokens of
the step), and the schedule does not rescale gradients, so the accumulated gradient equals the
non-pipelined run's. The loss sum is broadcast from the last stage's rank to the whole pp group.
With tensor parallelism and loss_parallel the logits stay vocabulary-sharded DTensors; the schedule
runs inside `loss_parallel()` so both the cross-entropy and its backward reduce across tp ranks.

Hooks for other objectives (RL, distillation), all public: `objective(logits, micro_batch, i)` is the last
stage's unscaled loss sum of micro-batch i (default: cross-entropy on the labels); `stage_loss_sum()` adds
a loss every stage computes itself (distillation's hidden-state terms) to the reported step loss;
`micro_batch_of(part)` tells a hook inside a stage which micro-batch the schedule is running (the index is
passed to the stage as an input, not read from the schedule); `forward_only(parts, batches, on_logits)`
runs any set of stage modules placed like this pipeline's (a teacher, a reference policy) forward only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from meshtron.compat import during_pipeline_shape_inference
from meshtron.config.fields import ConfigError
from meshtron.config.schema import RunConfig
from meshtron.nn.loss import masked_cross_entropy
from meshtron.nn.moe.balance import moe_bookkeeping_paused
from meshtron.parallel.dims import NamedMesh, ParallelDims, backend_options
from meshtron.parallel.pipeline_eval import forward_only
from meshtron.parallel.pipeline_stages import (
    PipelineStageModule,
    build_stage_modules,
    rank_of_stage,
    split_layers,
    stages_of_rank,
)


def schedule_class(name: str, virtual_stages: int) -> tuple[type, str]:
    """(torch schedule class, stage placement style) of `parallel.pp_schedule`."""
    if name == "gpipe":
        return ScheduleGPipe, "loop"
    if name == "1f1b":
        return Schedule1F1B, "loop"
    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B, "loop"
    if virtual_stages == 2:
        return ScheduleZBVZeroBubble, "v"
    return ScheduleInterleavedZeroBubble, "loop"


def num_micro_batches(cfg: RunConfig, dims: ParallelDims) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dims.dp)


def check_pipeline_config(cfg: RunConfig, dims: ParallelDims, micro_batches: bool = True) -> None:
    """One-line ConfigErrors for what the pipeline cannot run (the split is checked by split_layers).
    micro_batches=False skips the checks of train.global_batch_size's micro-batch count (RL pads its
    own count to what the schedule needs)."""
    p, m = cfg.parallel, num_micro_batches(cfg, dims)
    v = p.pp_virtual_stages
    _, style = schedule_class(p.pp_schedule, v)
    num_stages = dims.pp * v
    if cfg.model.tie_word_embeddings and rank_of_stage(0, dims.pp, num_stages, style) == rank_of_stage(
            num_stages - 1, dims.pp, num_stages, style):
        raise ConfigError(f"model.tie_word_embeddings: tied embeddings are not supported with the {p.pp_schedule} "
                          "schedule, which puts the first and last stage on one rank; set it false or use "
                          "pp_schedule 1f1b, gpipe or interleaved_1f1b")
    if p.pp_schedule in ("gpipe", "1f1b") and v != 1:
        raise ConfigError(f"parallel.pp_virtual_stages: {v} is not allowed with pp_schedule {p.pp_schedule} (one stage "
                          "per rank); set it to 1 or use pp_schedule interleaved_1f1b or zero_bubble")
    if micro_batches and p.pp_schedule == "1f1b" and m < p.pp:
        raise ConfigError(f"train.global_batch_size: 1f1b needs at least pp={p.pp} micro-batches per step, got {m} "
                          "(global_batch_size / (micro_batch_size * dp)); raise global_batch_size or use gpipe")
    if micro_batches and p.pp_schedule in ("interleaved_1f1b", "zero_bubble") and not (
            p.pp_schedule == "zero_bubble" and v == 2):
        rounds = max(1, m // p.pp)
        if m % rounds:
            raise ConfigError(f"train.global_batch_size: {p.pp_schedule} needs the {m} micro-batches per step to be a "
                              f"multiple of {rounds} (micro-batches // pp); make it a multiple of parallel.pp={p.pp}")
    if p.pp_schedule == "zero_bubble" and p.compile:
        raise ConfigError("parallel.compile: the zero_bubble schedule splits the backward, which torch.compile does "
                          "not support; set parallel.compile false or use another pp_schedule")


class Pipeline:
    """This rank's stages and the schedules that run them (built on first use, after TP/FSDP have
    been applied to `parts` in place)."""

    def __init__(self, parts: list[PipelineStageModule], stage_ids: list[int], num_stages: int, style: str,
                 mesh: NamedMesh, cfg: RunConfig, device: torch.device):
        self.parts, self.stage_ids, self.num_stages = parts, stage_ids, num_stages
        self.cfg, self.device = cfg, device
        self.group = mesh["pp"].get_group()
        pp = mesh["pp"].size()
        self.rank_of = lambda stage: rank_of_stage(stage, pp, num_stages, style)  # rank in the pp group
        self.has_last = (num_stages - 1) in stage_ids
        self.schedule_class, _ = schedule_class(cfg.parallel.pp_schedule, cfg.parallel.pp_virtual_stages)
        self.loss_parallel = mesh["tp"].size() > 1 and cfg.parallel.loss_parallel
        self._schedules: dict[int, Any] = {}
        # set per step, read by the loss function on the last stage
        self._batches: list[dict[str, torch.Tensor]] = []
        self._loss_scale, self._inject_nan = 1.0, False
        self._loss_sums: dict[int, torch.Tensor] = {}
        self._target: torch.Tensor | None = None  # the step's loss target, arange(micro-batches)
        self._inferring_shapes = False  # a stage's placeholder forward before its first step
        # the last stage's loss of one micro-batch, an unscaled sum (what is reported): objective(logits, mb, i)
        self.objective: Callable[[torch.Tensor, dict[str, torch.Tensor], int], torch.Tensor] = self.cross_entropy
        # a loss sum each stage adds itself (on this rank, for the step so far), summed over the pp group
        self.stage_loss_sum: Optional[Callable[[], float]] = None
        self.tied_group = None  # first/last-stage pair of a tied embedding (build_pipeline sets it)
        self.context_parallel = None
        if mesh["cp"].size() > 1:
            # every micro-batch reaching the pipeline is already cut to this cp rank's tokens (the trainer's
            # shard_batch); each stage runs ring attention over cp, and the hidden states sent between
            # stages are those cp-local tokens
            from meshtron.parallel.context_parallel import ContextParallel

            self.context_parallel = ContextParallel(mesh["cp"], load_balance=cfg.parallel.cp_load_balance)
            for part in parts:
                part.context_parallel = self.context_parallel

    # ---- the two entry points the trainer calls -----------------------------------------------

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], total_tokens: float,
                   inject_nan: bool = False) -> float:
        """Forward and backward of every micro-batch; gradients accumulate into the parameters.
        Returns the sum of token losses of these micro-batches, the same on every pp rank."""
        self._begin(micro_batches, 1.0 / max(total_tokens, 1.0), inject_nan)
        schedule = self._schedule(len(micro_batches))
        args, kwargs, target = self._schedule_inputs(micro_batches)
        with self._contexts():
            schedule.step(*args, target=target, return_outputs=False, **kwargs)
        self._sum_tied_gradients()
        loss_sum = self._broadcast_loss_sum(len(micro_batches))
        self._batches = []
        return loss_sum

    def eval_step(self, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        """Forward only: (sum of token losses, number of loss tokens) of `batches`, same on every pp rank."""
        self._begin(batches, 1.0, False)
        with torch.no_grad(), self._contexts():
            self.forward_only(self.parts, batches, self.micro_batch_loss)
        _reshard(self.parts)  # FSDP parameters kept gathered by forward (zero-bubble, ZeRO-2) are freed
        num_tokens = float(sum(mb["loss_mask"].sum(dtype=torch.float64) for mb in batches))  # one host sync
        loss_sum = self._broadcast_loss_sum(len(batches))
        self._batches = []
        return loss_sum, num_tokens

    # ---- hooks for other objectives ------------------------------------------------------------

    @property
    def batches(self) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of the step (or evaluation) running now."""
        return self._batches

    @property
    def loss_scale(self) -> float:
        """What each micro-batch's loss is multiplied by for backward: 1 / the step's loss tokens."""
        return self._loss_scale

    def cross_entropy(self, logits: torch.Tensor, mb: dict[str, torch.Tensor], i: int) -> torch.Tensor:
        """The pretraining objective: the sum of token cross-entropies on mb's labels under its loss mask."""
        if self.loss_parallel:
            from meshtron.parallel.loss import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(logits, mb["labels"], mb["loss_mask"])[0]
        return masked_cross_entropy(logits, mb["labels"], mb["loss_mask"])[0]

    def micro_batch_loss(self, logits: torch.Tensor, i: int) -> torch.Tensor:
        """objective(...) * loss_scale of micro-batch i; the unscaled sum is kept for reporting."""
        loss = self.objective(logits, self._batches[i], i)
        if i == 0 and self._inject_nan:
            loss = loss * float("nan")
        self._loss_sums[i] = loss.detach()
        return loss * self._loss_scale

    def micro_batch_of(self, part: nn.Module) -> Optional[int]:
        """The index of the micro-batch `part` (one of this rank's stage modules) is running in a training
        schedule's forward now; None in evaluation, outside a forward and in the stage's shape inference."""
        index = getattr(part, "micro_batch", None)
        if index is None or self._inferring_shapes:
            return None
        return self._index_of(index)

    def forward_only(self, parts: list[nn.Module], batches: list[dict[str, torch.Tensor]],
                     on_logits: Callable[[torch.Tensor, int], Any],
                     inputs_of: Optional[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = None) -> None:
        """Forward `batches` through `parts` (stage modules placed like this pipeline's: its own, a frozen
        copy, a teacher's); the last stage hands (logits, micro-batch index) to `on_logits`."""
        forward_only(parts, self.stage_ids, self.num_stages, self.rank_of, self.group, self.device, batches,
                     inputs_of or self._stage_kwargs, on_logits)

    # ---- pieces ---------------------------------------------------------------------------------

    def _begin(self, batches: list[dict[str, torch.Tensor]], loss_scale: float, inject_nan: bool) -> None:
        self._batches, self._loss_scale, self._inject_nan = batches, loss_scale, inject_nan
        self._loss_sums = {}

    def _schedule(self, n: int):
        """The training schedule for n micro-batches, with its own PipelineStage objects (a stage's
        buffers are shaped for one schedule's micro-batch count)."""
        if n not in self._schedules:
            stages = [PipelineStage(part, s, self.num_stages, self.device, group=self.group)
                      for part, s in zip(self.parts, self.stage_ids)]
            for stage in stages:  # the placeholder forward of shape inference is no MoE forward to count
                during_pipeline_shape_inference(stage, lambda part=stage.submod: self._shape_inference(part))
            cls = self.schedule_class
            if cls in _ZERO_BUBBLE:
                _keep_gathered_until_backward(self.parts)
            stage_arg = stages if cls in _MULTI else stages[0]
            self._schedules[n] = cls(stage_arg, n, loss_fn=self._loss_fn, scale_grads=False)
        return self._schedules[n]

    @contextmanager
    def _shape_inference(self, part: nn.Module) -> Iterator[None]:
        self._inferring_shapes = True
        try:
            with moe_bookkeeping_paused(part):
                yield
        finally:
            self._inferring_shapes = False

    def _schedule_inputs(self, batches: list[dict[str, torch.Tensor]]):
        """Whole-step tensors that the schedule splits back into `batches` along dim 0: tokens for
        the first stage, positions (and document ids) for every stage, and as the loss target the
        micro-batch index, with which the loss function finds its labels and loss mask. The same index goes
        to every stage as the `micro_batch` input (`micro_batch_of`)."""
        tokens = torch.cat([mb["input_ids"] for mb in batches])
        per_batch = [self._stage_kwargs(mb) for mb in batches]
        kwargs = {k: torch.cat([kw[k] for kw in per_batch]) for k in per_batch[0]}
        args = (tokens,) if 0 in self.stage_ids else ()
        target = torch.arange(len(batches), device=tokens.device)
        self._target = target  # the loss function finds a micro-batch's index from its chunk of it
        kwargs["micro_batch"] = target
        return args, kwargs, target

    def _stage_kwargs(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return stage_inputs(mb, self.context_parallel)

    def _loss_fn(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: `index` holds the micro-batch index (the target we gave it). Also
        called once by the stage's shape inference (index 0, overwritten by the real call)."""
        return self.micro_batch_loss(logits, self._index_of(index))

    def _index_of(self, index: torch.Tensor) -> int:
        """The micro-batch index of the schedule's chunk of our target. The schedule splits the target
        arange(m) into views, so the chunk's offset in its storage is the index: metadata, no read of
        the device tensor (reading it would be a host sync per micro-batch). A chunk that is not a view
        of our target (copied by the schedule) is read."""
        target = self._target
        if (target is not None and index.numel() == 1 and index.device == target.device
                and index.untyped_storage().data_ptr() == target.untyped_storage().data_ptr()):
            return index.storage_offset() - target.storage_offset()
        return int(index.reshape(-1)[0])

    def tied_copies(self) -> list[torch.nn.Parameter]:
        """The last stage's copy of a tied embedding (counted once by the gradient norm)."""
        return [part.embedding.weight for part in self.parts if part.tied_copy]

    def _sum_tied_gradients(self) -> None:
        """Tied embeddings: the first stage's embedding and the last stage's copy are one parameter of
        the single-process model, whose gradient is the sum of both uses; all-reduce their gradients
        over the first/last pair so both copies take the same optimizer step. Under TP both copies are
        the same vocabulary shard, but the lookup's backward may leave the first stage's gradient
        replicated (full vocabulary): each side's gradient is first laid out like its parameter, so
        the pair reduces matching shards."""
        if self.tied_group is None:
            return
        for part in self.parts:
            if part.is_first or part.tied_copy:
                weight = part.embedding.weight
                grad = weight.grad
                if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(weight.placements):
                    grad = grad.redistribute(weight.device_mesh, weight.placements)
                    weight.grad = grad
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                dist.all_reduce(local, group=self.tied_group)

    def _broadcast_loss_sum(self, n: int) -> float:
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.has_last:
            assert sorted(self._loss_sums) == list(range(n)), "the schedule skipped a micro-batch's loss"
            value += sum(self._loss_sums[i].double() for i in range(n))
        dist.broadcast(value, group=self.group, group_src=self.rank_of(self.num_stages - 1))
        if self.stage_loss_sum is not None:
            extra = torch.tensor(self.stage_loss_sum(), dtype=torch.float64, device=self.device)
            dist.all_reduce(extra, group=self.group)
            value += extra
        return float(value)

    def _contexts(self) -> ExitStack:
        """bf16 autocast like the non-pipelined forward; loss_parallel around forward and backward."""
        stack = ExitStack()
        if self.cfg.train.precision == "bf16":
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        if self.loss_parallel:
            from meshtron.parallel.loss import loss_parallel

            stack.enter_context(loss_parallel())
        return stack


_ZERO_BUBBLE = (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
_MULTI = (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)


def _reshard(parts: list[nn.Module]) -> None:
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _keep_gathered_until_backward(parts: list[nn.Module]) -> None:
    """Zero-bubble's input-gradient pass finds the weights of the autograd graph through the module's
    registered parameters; FSDP registers the sharded ones again after a resharding forward, and those
    weights' gradients would be lost. So under zero-bubble FSDP keeps parameters gathered from forward
    to backward (ZeRO-2 within the step; the schedule's final gradient reduction reshards them)."""
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        if isinstance(part, FSDPModule):
            part.set_reshard_after_forward(False, recurse=True)


def stage_inputs(mb: dict[str, torch.Tensor], context_parallel=None) -> dict[str, torch.Tensor]:
    """Keyword inputs of every stage for one micro-batch: (batch, seq) positions, the sample's own
    (restarted at document starts) or 0..seq-1, and the document ids of packed samples. Under context
    parallelism the micro-batch holds this cp rank's tokens and the default positions are their global ones."""
    positions = mb.get("position_ids")
    if positions is None:
        batch, seq = mb["input_ids"].shape
        if context_parallel is not None:
            positions = context_parallel.global_positions(batch, seq, mb["input_ids"].device)
        else:
            positions = torch.arange(seq, device=mb["input_ids"].device).expand(batch, seq).contiguous()
    if mb.get("document_ids") is None:
        return {"positions": positions}
    return {"positions": positions, "document_ids": mb["document_ids"]}


def build_pipeline(model: nn.Module, mesh: NamedMesh, dims: ParallelDims, cfg: RunConfig,
                   device: torch.device, pipeline_class: type[Pipeline] = Pipeline,
                   check_micro_batches: bool = True) -> Pipeline:
    """Split `model` (built identically on every rank) into stages and keep this rank's.
    `pipeline_class`: a Pipeline subclass with another loss (RL's)."""
    p = cfg.parallel
    check_pipeline_config(cfg, dims, check_micro_batches)
    num_stages = dims.pp * p.pp_virtual_stages
    ranges = split_layers(len(cfg.model.pattern), num_stages, p.pp_first_stage_sublayers, p.pp_last_stage_sublayers)
    _, style = schedule_class(p.pp_schedule, p.pp_virtual_stages)
    stage_ids = stages_of_rank(mesh["pp"].get_local_rank(), dims.pp, num_stages, style)
    parts = build_stage_modules(model, ranges, stage_ids)
    pipeline = pipeline_class(parts, stage_ids, num_stages, style, mesh, cfg, device)
    if cfg.model.tie_word_embeddings:
        pipeline.tied_group = _first_last_group(mesh, dims, num_stages, style, p.timeout_s)
    return pipeline


def _first_last_group(mesh: NamedMesh, dims: ParallelDims, num_stages: int, style: str, timeout_s: float):
    """This rank's group of the ranks holding the first and the last stage of its pipeline (None if it
    holds neither). Every rank creates every pair's group, in the same order."""
    root = mesh.root
    pp_axis = root.mesh_dim_names.index("pp")
    pipelines = root.mesh.movedim(pp_axis, -1).reshape(-1, dims.pp)  # one row of global ranks per pipeline
    first, last = rank_of_stage(0, dims.pp, num_stages, style), rank_of_stage(num_stages - 1, dims.pp, num_stages, style)
    backend, options = backend_options(root.device_type, timeout_s)
    mine = None
    for row in pipelines.tolist():
        pair = [row[first], row[last]]
        group = dist.new_group(pair, backend=backend, pg_options=options, timeout=timedelta(seconds=timeout_s))
        if dist.get_rank() in pair:
            mine = group
    return mine
