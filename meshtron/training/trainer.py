"""The single-process training loop: build everything from a `RunConfig`, then repeat
data -> forward/backward over micro-batches -> clip -> optimizer step -> metrics -> eval -> checkpoint.

The loss of a global batch is the sum of token losses over all its micro-batches divided by the
number of loss tokens in the whole batch, so accumulation gives the same gradient as one big batch.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from meshtron.checkpoint import CheckpointManager, load_checkpoint, trainer_state_errors
from meshtron.checkpoint.carry import self_contained_config
from meshtron.config.fields import ConfigError
from meshtron.config.loader import config_to_dict, save_config
from meshtron.config.schema import AUTO_LOAD, RunConfig
from meshtron.data.build import build_datasets
from meshtron.data.loader import BatchLoader, fixed_batches
from meshtron.data.tokenizer import build_tokenizer
from meshtron.models.gpt import GPTModel, count_parameters, flops_per_token
from meshtron.models.mtp import combine_losses, forward_for_loss
from meshtron.nn.context import PackedContext
from meshtron.nn.loss import masked_cross_entropy
from meshtron.nn.moe.balance import end_of_step, moe_layers, set_aux_loss_scale
from meshtron.parallel import parallelize_parts
from meshtron.parallel.clip import clip_grad_norm_
from meshtron.parallel.dims import ParallelDims
from meshtron.parallel.distributed import all_reduce_sum, init_distributed
from meshtron.parallel.parts import ModelParts
from meshtron.parallel.random import DROPOUT_RNG_KEY, apply_dropout_rng
from meshtron.parallel.watchdog import Watchdog, step_time_extremes
from meshtron.training.flops import resolve_peak_flops
from meshtron.training.grad_capture import GradCapture
from meshtron.training.interrupt import RunInterrupted, StopOnSignal, signal_name
from meshtron.training.lr_schedule import LRSchedule
from meshtron.training.memory import configure_cuda_allocator, interval_peak_memory
from meshtron.training.metrics import MetricsLogger, format_duration
from meshtron.training.optimizer import build_optimizer
from meshtron.training.plot import write_loss_curve
from meshtron.training.precision import enable_tf32, resolve_precision
from meshtron.training.profiling import Ranges, StepProfiler
from meshtron.training.resume import resolve_load, save_dir
from meshtron.training.run_dir import save_interval
from meshtron.training.timers import Timers


class TrainingError(RuntimeError):
    """Training stopped for a reason the user must act on; the message says which and what to do."""


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    num_tokens: int
    skipped: bool
    extra: dict[str, float] = field(default_factory=dict)  # separately logged losses, e.g. MTP depths (issue 4)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device: 'cuda' requested but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: RunConfig, echo: bool = True):
        self.cfg, self.echo = cfg, echo
        self.ranges = Ranges(nvtx=cfg.profile.nvtx)   # named ranges for the profiler (and NVTX on CUDA)
        self.timers = Timers(annotate=self.ranges)
        t = cfg.train
        if t.num_threads is not None:
            torch.set_num_threads(t.num_threads)
        configure_cuda_allocator()   # expandable segments, before CUDA is initialised
        self.device = resolve_device(t.device)
        t.precision = resolve_precision(t.precision, self.device)   # auto -> bf16 on CUDA, fp32 on a CPU
        enable_tf32(self.device)
        self.run_dir = Path(t.run_dir)
        with self.timers.startup_phase("distributed"):
            self._setup_distributed()
        seed_everything(t.seed)
        with self.timers.startup_phase("data"):
            self._build_data()
        with self.timers.startup_phase("model"):
            self._build_model()
        self.grad_capture = (GradCapture(self.model_parts, cfg, self.dims, self.group("dp"), self.rank)
                             if cfg.grads.save_wgrads or cfg.grads.save_dgrads else None)
        self.profiler = StepProfiler(cfg.profile, self.run_dir, self.rank)
        self.num_params = count_parameters(cfg.model, self.tokenizer.vocab_size)
        self.flops_per_token = flops_per_token(cfg.model, self.tokenizer.vocab_size, cfg.data.seq_length)
        self.step = 0
        self.nonfinite_in_a_row = 0
        self.num_skipped = 0
        self.history: list[StepResult] = []
        self.watchdog: Optional[Watchdog] = None
        self.saved_step: Optional[int] = None        # the step of the newest checkpoint of this run
        self.last_valid: Optional[tuple[int, float]] = None   # (step, loss) of the latest evaluation
        self.stop = StopOnSignal()                   # SIGTERM/SIGINT during train(): checkpoint, then stop
        self.stopped_by: Optional[int] = None
        self.checkpoints = CheckpointManager(save_dir(cfg), cfg.checkpoint.keep_last, cfg.checkpoint.async_save,
                                             timeout_s=cfg.parallel.timeout_s)
        self.resumed_from = resolve_load(cfg, self.device)  # checkpoint.load, or what `auto` found (None: fresh)
        if self.resumed_from is not None:
            with self.timers.startup_phase("checkpoint_load"):
                self.load(self.resumed_from)
        with self.timers.startup_phase("peak_flops"):
            # a known GPU's datasheet peak, else a measured matmul (see training/flops.py)
            peak, source = resolve_peak_flops(t.peak_flops, self.device, t.precision)
            self.peak_flops = peak
            self.peak_flops_source = source

    def _setup_distributed(self) -> None:
        p = self.cfg.parallel
        world_size = init_distributed(self.device, p.timeout_s, self.run_dir)
        self.dims = ParallelDims.from_config(p, world_size)
        self.mesh = self.dims.build_mesh(self.device.type, p.timeout_s) if world_size > 1 else None
        self.rank = dist.get_rank() if world_size > 1 else 0
        self._groups: dict[str, Any] = {}

    def group(self, axis: str):
        """The process group of a mesh axis (None in a single process), looked up once: slicing a
        DeviceMesh each step costs host work (index searches on the rank grid)."""
        if self.mesh is None:
            return None
        if axis not in self._groups:
            self._groups[axis] = self.mesh[axis].get_group()
        return self._groups[axis]

    def _build_data(self) -> None:
        t, dims = self.cfg.train, self.dims
        if t.global_batch_size % (t.micro_batch_size * dims.dp):
            raise ConfigError(f"train.global_batch_size: {t.global_batch_size} is not allowed; must be a multiple of "
                              f"micro_batch_size * data-parallel size = {t.micro_batch_size} * {dims.dp}")
        self.tokenizer = build_tokenizer(self.cfg.tokenizer)
        self.train_ds, self.valid_ds, _ = build_datasets(self.cfg, self.tokenizer)
        dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None else 0
        self.loader = BatchLoader(self.train_ds, micro_batch_size=t.micro_batch_size,
                                  global_batch_size=t.global_batch_size, seed=self.cfg.data.seed,
                                  dp_rank=dp_rank, dp_size=dims.dp)

    def _build_model(self) -> None:
        """Every rank builds the full model from the same seed (identical weights), then keeps and
        shards its part: pipeline stages, then TP / recompute / compile / FSDP."""
        cfg = self.cfg
        # --- issue 4: train.init_from_hf takes the architecture and weights from a HF directory -----
        if cfg.train.init_from_hf:
            from meshtron.models.hf import init_model_from_hf

            cfg.model, model = init_model_from_hf(cfg.train.init_from_hf, cfg.model, self.tokenizer.vocab_size,
                                                  self.device, seq_length=cfg.data.seq_length)
        else:
            model = GPTModel(cfg.model, self.tokenizer.vocab_size).to(self.device)
        self.extend_model(model)
        if cfg.model.mtp_num_layers and (self.dims.tp > 1 or self.dims.cp > 1 or self.dims.pp > 1):
            raise ConfigError(f"model.mtp_num_layers: {cfg.model.mtp_num_layers} is not allowed with tp, cp or pp > 1 "
                              "yet (MTP shifts whole sequences through a replicated head); set it to 0")
        # --------------------------------------------------------------------------------------------
        self.vocab_size = model.vocab_size
        self.pipeline = None
        if self.dims.pp > 1:
            self.pipeline = self.build_pipeline(model)
            parts = self.pipeline.parts
            for part in parts:
                part.annotate = self.ranges  # "forward" ranges of each stage inside the schedule
            self.extend_stages(parts)
        else:
            parts = [model]
        parallelize_parts(parts, self.dims, self.mesh, cfg)
        # dropout streams per rank (parallel/random.py), after every rank built the same weights
        self.dropout_rng = apply_dropout_rng(parts, self.mesh, cfg.train.seed, self.device,
                                             sequence_parallel=self.dims.tp > 1 and cfg.parallel.sequence_parallel)
        self.model_parts = parts
        self.model = parts[0] if self.pipeline is None else ModelParts(parts)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.schedule = LRSchedule(cfg.optimizer.lr, cfg.scheduler, cfg.train.train_iters)
        self.has_moe = bool(moe_layers(parts))
        self.moe_details: dict[str, Any] = {}  # per-layer MoE statistics of the last step (logged as kind "moe")
        self.context_parallel = None
        if self.dims.cp > 1:
            from meshtron.parallel.context_parallel import ContextParallel

            self.context_parallel = ContextParallel(self.mesh["cp"], load_balance=cfg.parallel.cp_load_balance)

    def build_pipeline(self, model: GPTModel):
        """This rank's pipeline stages of the full model and the schedules that run them. Extension
        point: RL builds it without the pretraining micro-batch checks (it pads its own micro-batches)."""
        from meshtron.parallel.pipeline import build_pipeline

        return build_pipeline(model, self.mesh, self.dims, self.cfg, self.device)

    def extend_model(self, model: GPTModel) -> None:
        """Extension point: add trainable modules to the full model before it is split, sharded and
        given to the optimizer (distillation attaches its projections here). Default: nothing."""

    def extend_stages(self, parts: list[torch.nn.Module]) -> None:
        """Extension point under pipeline parallelism: place what `extend_model` added onto this rank's
        stage modules, after the split and before sharding and the optimizer. Default: nothing."""

    # ---- one optimizer step -------------------------------------------------------------------

    def _autocast(self):
        if self.cfg.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _loss_context(self):
        """Vocabulary-parallel cross-entropy needs its forward and backward inside `loss_parallel`."""
        if self.dims.tp > 1 and self.cfg.parallel.loss_parallel:
            from meshtron.parallel.loss import loss_parallel

            return loss_parallel()
        return nullcontext()

    def _local_micro_batch(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Move to the device and, under context parallelism, keep this rank's part of the sequence."""
        mb = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
        if self.context_parallel is not None:
            mb = self.context_parallel.shard_batch(mb)
        return mb

    def _context(self, mb: dict[str, torch.Tensor]):
        """A fresh model context for a local micro-batch (packed documents; this rank's part under CP)."""
        if self.context_parallel is not None:
            return self.context_parallel.context(mb)
        return PackedContext.for_tokens(mb["input_ids"], mb.get("document_ids"), mb.get("position_ids"))

    def _forward_loss(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """(sum of token losses, number of loss tokens, extra losses to log) of one local micro-batch.
        Extension point: distillation overrides it (meshtron/distill/trainer.py)."""
        ctx = self._context(mb)
        # MTP (issue 4): in training, a model with mtp_num_layers > 0 also returns the logits of its
        # MTP depths; combine_losses adds their scaled losses to the sum and returns each depth's
        # (sum, count) and the plain LM loss as extras, which train_step logs separately.
        with self._autocast():
            logits, mtp_logits = forward_for_loss(self.model, mb["input_ids"], ctx)
        cross_entropy = masked_cross_entropy
        if self.dims.tp > 1 and self.cfg.parallel.loss_parallel:
            from meshtron.parallel.loss import vocab_parallel_cross_entropy as cross_entropy
        return combine_losses(logits, mtp_logits, mb["labels"], mb["loss_mask"], mb.get("document_ids"),
                              self.cfg.model, cross_entropy)

    def _global_sum(self, value: float | torch.Tensor) -> float:
        """Sum a per-rank number over the ranks that hold different tokens (dp x cp)."""
        return self._global_sums([value])[0]

    def _global_sums(self, values: list[float | torch.Tensor]) -> list[float]:
        """Sum per-rank numbers (floats or 0-d tensors on the device) over dp x cp in one all-reduce,
        on the device (NCCL takes no CPU tensor), read back with one host sync."""
        if not values:
            return []
        packed = torch.stack([torch.as_tensor(v, device=self.device).detach().double().reshape(()) for v in values])
        if self.mesh is not None:
            with self._phase("communication"):
                all_reduce_sum(packed, self.group("dp_cp"))
        return packed.tolist()

    def _fsdp_modules(self) -> list[Any]:
        """Every FSDP unit of this rank's parts (found once)."""
        if not hasattr(self, "_fsdp_units"):
            from torch.distributed.fsdp import FSDPModule

            self._fsdp_units = [m for part in self.model_parts for m in part.modules() if isinstance(m, FSDPModule)]
        return self._fsdp_units

    def _gradient_sync(self, enabled: bool) -> None:
        """FSDP reduces gradients (reduce-scatter; HSDP: and all-reduce) only in the backward of a step's
        last micro-batch: the earlier ones accumulate unsharded gradients locally (one reduction per step
        instead of one per micro-batch, for the memory of one unsharded gradient per FSDP unit)."""
        for unit in self._fsdp_modules():
            unit.set_requires_gradient_sync(enabled, recurse=False)
        if hasattr(self.optimizer, "set_last_micro_batch"):   # offload: copy gradients to the host once per step
            self.optimizer.set_last_micro_batch(enabled)

    @contextmanager
    def _phase(self, name: str, detail: str = "") -> Iterator[None]:
        """A named range for the profiler / NVTX (`name`) that is also a watchdog heartbeat
        (`name` + `detail`, e.g. "forward of micro-batch 1"), so a hang names the phase it is in."""
        if self.watchdog is not None:
            self.watchdog.beat(f"{name}{detail}")
        with self.ranges(name):
            yield

    @contextmanager
    def _guard(self, activity: str, step: int, backstop: bool = False) -> Iterator[None]:
        """Run an activity with collectives (training step, evaluation, checkpoint save, straggler
        report) so that if a collective fails or times out, the run ends on every rank with the
        activity, the phase and the ranks that did not arrive named, and every rank's stack dumped
        (see parallel/watchdog.py). `backstop`: also end it if this rank stalls outside collectives."""
        if self.watchdog is None:
            yield
            return
        with self.watchdog.activity(activity, step, backstop=backstop):
            try:
                yield
            except TrainingError:
                raise
            except RuntimeError as e:  # gloo/NCCL report timeouts and peer failures as RuntimeError
                raise TrainingError(self.watchdog.collective_failed(e)) from e

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """Accumulate gradients over the micro-batches, clip, and step unless anything is non-finite."""
        for part in self.model_parts:
            part.train()
        lr = self.schedule(self.step + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        micro_batches = [self._local_micro_batch(mb) for mb in micro_batches]
        total_tokens = self.loss_normaliser(micro_batches)
        if self.grad_capture is not None:
            self.grad_capture.begin(self.step + 1)
        inject = (self.step + 1) in self.cfg.train.debug_nonfinite_steps
        if self.has_moe:
            # each MoE forward's aux loss enters the objective with weight 1 / (forwards of the step on all
            # ranks that see different tokens): the objective adds the step's mean aux loss
            set_aux_loss_scale(self.model_parts, 1.0 / (len(micro_batches) * self.dims.dp * self.dims.cp))
        with self.timers.phase("forward_backward"):
            if self.pipeline is not None:
                with self._phase("pipeline", " schedule (forward and backward)"):
                    loss_sum = self.pipeline.train_step(micro_batches, total_tokens, inject_nan=inject)
            else:
                loss_sum, extra_sums = self._accumulate(micro_batches, total_tokens, inject)
            # the loss and the logged extras (MTP depths) in one all-reduce and one host sync
            names = sorted(extra_sums) if self.pipeline is None else []
            sums = self._global_sums([loss_sum] + [x for n in names for x in extra_sums[n]])
            mean_loss = sums[0] / max(total_tokens, 1.0)
            extra_means = {n: sums[1 + 2 * k] / max(sums[2 + 2 * k], 1.0) for k, n in enumerate(names)}
        if self.grad_capture is not None:
            self.grad_capture.save()
        with self.timers.phase("optimizer"):
            clip = self.cfg.optimizer.clip_grad if self.cfg.optimizer.clip_grad > 0 else float("inf")
            with self._phase("grad_norm"):
                grad_norm = clip_grad_norm_(list(self.model.parameters()), clip, self.group("pp"), annotate=self.ranges,
                                            duplicates=tuple(self.pipeline.tied_copies()) if self.pipeline else ())
            skipped = not (math.isfinite(mean_loss) and math.isfinite(grad_norm))
            if not skipped:
                with self._phase("optimizer_step"):  # inside the timers' "optimizer" range (grad norm + step)
                    self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.has_moe:
            extra_means.update(self._moe_step_metrics())
        self.step += 1
        return StepResult(self.step, mean_loss, grad_norm, lr, int(total_tokens), skipped, extra_means)

    def loss_normaliser(self, micro_batches: list[dict[str, torch.Tensor]]) -> float:
        """What the step's summed micro-batch losses are divided by: the loss tokens over dp x cp (one
        all-reduce and one host sync per step). Extension point: an objective whose micro-batch losses
        already carry global weights (GRPO, meshtron/rl/trainer.py) returns 1."""
        return self._global_sum(sum(mb["loss_mask"].sum(dtype=torch.float64) for mb in micro_batches))

    def _accumulate(self, micro_batches: list[dict[str, torch.Tensor]], total_tokens: float,
                    inject: bool) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
        """Forward and backward of every micro-batch (no pipeline); -> (sum of token losses, {extra loss
        name: [sum, tokens]}), kept on the device: no host sync per micro-batch."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        extra_sums: dict[str, list[torch.Tensor]] = {}  # MTP (issue 4): name -> [loss sum, tokens]
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            self._gradient_sync(i == last)
            with self._loss_context():
                with self._phase("forward", f" of micro-batch {i}"):
                    loss, _, extra = self._forward_loss(mb)
                if i == 0 and inject:
                    loss = loss * float("nan")
                with self._phase("backward", f" of micro-batch {i}"):
                    (loss / max(total_tokens, 1.0)).backward()
            loss_sum += loss.detach().double()
            for name, (value, count) in extra.items():
                acc = extra_sums.setdefault(name, [loss_sum.new_zeros(()), loss_sum.new_zeros(())])
                acc[0] += torch.as_tensor(value, device=self.device).detach().double()
                acc[1] += torch.as_tensor(count, device=self.device).double()
        return loss_sum, extra_sums

    def _moe_step_metrics(self) -> dict[str, float]:
        """Reduce this step's MoE statistics over the data ranks, update expert biases (every rank the
        same), keep the per-layer details for the "moe" log record, return the summary for the step."""
        def reduce(value: torch.Tensor) -> torch.Tensor:
            with self._phase("communication", " (MoE statistics)"):
                return all_reduce_sum(value, self.group("dp_cp"))

        metrics = end_of_step(self.model_parts, None if self.mesh is None else reduce)
        self.moe_details = {k: v for k, v in metrics.items() if k.startswith(("moe_load_", "moe_dropped_L"))}
        summary = {k: v for k, v in metrics.items() if k not in self.moe_details}
        load_max = [v for k, v in self.moe_details.items() if k.startswith("moe_load_max_")]
        if load_max:
            summary["moe_load_max"] = max(load_max)
        return summary

    def _account_nonfinite(self, result: StepResult, logger: MetricsLogger) -> None:
        if not result.skipped:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        self.num_skipped += 1
        logger.log(result.step, {"loss": result.loss, "grad_norm": result.grad_norm,
                                 "skipped_in_a_row": self.nonfinite_in_a_row}, kind="skipped")
        limit = self.cfg.train.max_nonfinite_steps
        if self.nonfinite_in_a_row >= limit:
            raise TrainingError(
                f"stopped at step {result.step}: {limit} consecutive steps had a non-finite loss or gradient norm; "
                "lower optimizer.lr, check the data, or resume from an earlier checkpoint")

    # ---- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        """Loss and perplexity on the first eval_iters validation micro-batches (the same every time)."""
        batches = fixed_batches(self.valid_ds, self.cfg.train.micro_batch_size, self.cfg.train.eval_iters)
        if not batches:
            return None
        for part in self.model_parts:
            part.eval()
        batches = [self._local_micro_batch(mb) for mb in batches]
        pair = torch.zeros(2, dtype=torch.float64, device=self.device)  # (loss sum, tokens): no sync per batch
        if self.pipeline is not None:
            with self._phase("pipeline", " forward-only schedule"):
                pair += torch.tensor(self.pipeline.eval_step(batches), dtype=torch.float64, device=self.device)
        else:
            for i, mb in enumerate(batches):
                with self._loss_context(), self._phase("forward", f" of validation batch {i}"):
                    loss, n, _ = self._forward_loss(mb)
                pair[0] += loss.detach().double()
                pair[1] += torch.as_tensor(n, device=self.device).double()
        # every data-parallel rank evaluated the same batches: sum over cp only
        if self.mesh is not None and self.dims.cp > 1:
            with self._phase("communication", " (validation loss over cp)"):
                all_reduce_sum(pair, self.group("cp"))
        loss_sum, tokens = pair.tolist()
        loss = loss_sum / max(tokens, 1.0)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}

    # ---- checkpoints ---------------------------------------------------------------------------

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides weights and optimizer; a collective (every rank's dropout
        streams are gathered), so every rank calls it."""
        return {"step": self.step, "data": self.loader.state_dict(), "rng": rng_state(),
                "schedule": self.schedule.state_dict(), "nonfinite_in_a_row": self.nonfinite_in_a_row,
                "num_skipped": self.num_skipped, DROPOUT_RNG_KEY: self.dropout_rng.state_dict()}

    def save(self) -> None:
        config_yaml, carried = self_contained_config(config_to_dict(self.cfg))  # the tokenizer travels along
        self.checkpoints.save(self.step, self.model, self.optimizer, self.trainer_state(), config_yaml,
                              extra_dirs=carried)
        self.saved_step = self.step

    def load(self, path: str | Path) -> None:
        state = load_checkpoint(path, self.model, self.optimizer)
        if state.get("model_only"):  # issue 4: a converted (HF) checkpoint holds weights only; start at step 0
            return
        with trainer_state_errors(path):  # a hand-edited trainer_state.json is one line, not a traceback
            self.step = int(state["step"])
            self.loader.load_state_dict(state["data"])
            self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
            self.num_skipped = int(state.get("num_skipped", 0))
            set_rng_state(state["rng"])
            self.dropout_rng.load_state_dict(state.get(DROPOUT_RNG_KEY), self.step)  # this rank's own streams
        if Path(path).resolve().is_relative_to(self.checkpoints.save_dir.resolve()):
            self.saved_step = self.step   # resumed from this run's own checkpoint: no need to write it again

    # ---- the loop ------------------------------------------------------------------------------

    def train(self) -> list[StepResult]:
        cfg, t = self.cfg, self.cfg.train
        self.started = time.perf_counter()
        if self.rank == 0:
            save_config(cfg, self.run_dir / "config.yaml")
        logger = MetricsLogger(cfg.logger, self.run_dir, t.train_iters, config_to_dict(cfg), initial_step=self.step,
                               enabled=self.rank == 0)
        # under NCCL a hung collective ends the process at the timeout (see parallel/watchdog.py): report earlier
        early = cfg.parallel.timeout_s / 2 if self.device.type == "cuda" else None
        self.watchdog = Watchdog(self.run_dir, cfg.parallel.timeout_s, report_after_s=early) if self.mesh is not None else None
        try:
            with self.stop:
                self._announce(logger)
                self._loop(logger)
                if self.stopped_by is None and t.eval_interval and self.step % t.eval_interval:
                    self._evaluate_and_log(logger)   # the summary's valid loss is that of the final weights
                self.finish(logger)
        finally:
            self.profiler.close()
            logger.close()
            if self.watchdog is not None:
                self.watchdog.close()
        return self.history

    # ---- the end of a run: final checkpoint, curves, summary; or a stop on a signal ----------------

    def should_stop(self) -> bool:
        """At a step boundary: did any rank get SIGTERM/SIGINT? Every rank answers the same (a collective)."""
        with self._guard("stop-signal check after step", self.step):
            self.stopped_by = self.stop.agreed(self.device)
        return self.stopped_by is not None

    def finish(self, logger: MetricsLogger) -> None:
        """Save the final checkpoint (always after a stop signal), write the loss curve and the summary
        line; after a signal raise `RunInterrupted` (exit code 143 for SIGTERM, 130 for SIGINT)."""
        stopped = self.stopped_by is not None
        if (self.cfg.checkpoint.save_at_end or stopped) and self.step != self.saved_step and self.step > 0:
            with self._guard("checkpoint save at step", self.step):
                self.save()
        self.checkpoints.wait()
        if self.rank == 0:
            self.write_curves(logger)
        logger.message(self.summary())
        if stopped:
            where = f"checkpoint {self.checkpoint_path()}" if self.saved_step is not None else "no checkpoint"
            raise RunInterrupted(self.stopped_by, f"stopped by {signal_name(self.stopped_by)} at step {self.step} "
                                                  f"({where}); resume with --checkpoint.load auto")

    def write_curves(self, logger: MetricsLogger) -> None:
        """loss_curve.csv and (with the 'plot' extra) loss_curve.png of train and valid loss. Extension
        point: RL draws its reward curve instead."""
        if (self.run_dir / "metrics.jsonl").is_file():
            csv_path, png = write_loss_curve(self.run_dir)
            logger.message(f"loss curve: {png or csv_path}")

    def checkpoint_path(self) -> Optional[Path]:
        return None if self.saved_step is None else self.checkpoints.save_dir / f"step_{self.saved_step:08d}"

    def summary(self) -> str:
        """One line at the end of a run: steps, time, final train and valid loss, the checkpoint."""
        head = "done" if self.stopped_by is None else f"stopped by {signal_name(self.stopped_by)}"
        parts = [f"{head}: step {self.step}/{self.cfg.train.train_iters} in "
                 f"{format_duration(time.perf_counter() - self.started)}"]
        good = [r for r in self.history if isinstance(r, StepResult) and not r.skipped]
        if good:
            parts.append(f"train loss {good[-1].loss:.4f}")
        if self.last_valid is not None:
            parts.append(f"valid loss {self.last_valid[1]:.4f} (step {self.last_valid[0]})")
        path = self.checkpoint_path()
        parts.append(f"checkpoint {path}" if path is not None else "no checkpoint saved")
        return " | ".join(parts)

    def _guarded_step(self, batch: list[dict[str, torch.Tensor]]) -> StepResult:
        with self._guard("training step", self.step + 1, backstop=True):
            return self.train_step(batch)

    def _compute_clock(self) -> float:
        """The clock the straggler report ranks ranks by. On CPU: this thread's CPU time, which counts
        the rank's own work but not the time it waits in collectives (gloo waits block, on its own
        threads) nor time the OS gave to other processes; so the ranking shows the rank that computes
        slowest instead of noise. On CUDA: wall time (waits included; a profile shows more)."""
        return time.thread_time() if self.device.type == "cpu" else time.perf_counter()

    def _report_stragglers(self, logger: MetricsLogger, seconds: float) -> None:
        with self._guard("straggler report at step", self.step), self._phase("communication", " (step times)"):
            (slow, t_slow), (fast, t_fast) = step_time_extremes(seconds)
        logger.log(self.step, {"slowest_rank": slow, "slowest_s": t_slow, "fastest_rank": fast, "fastest_s": t_fast,
                               "clock": "cpu_time" if self.device.type == "cpu" else "wall"}, kind="stragglers")

    def _announce(self, logger: MetricsLogger) -> None:
        cfg = self.cfg
        logger.message(f"model: {self.num_params / 1e6:.2f}M parameters, pattern '{cfg.model.pattern}', "
                       f"vocab {self.vocab_size}, device {self.device.type}, {cfg.train.precision}")
        logger.message(f"data: {len(self.train_ds)} train / {len(self.valid_ds)} valid samples of "
                       f"{cfg.data.seq_length} tokens; global batch {cfg.train.global_batch_size} "
                       f"({self.loader.num_micro_batches} micro-batches of {cfg.train.micro_batch_size})")
        d = self.dims
        if d.world_size > 1:
            logger.message(f"parallel: world {d.world_size} = pp {d.pp} x dp_replicate {d.dp_replicate} x "
                           f"dp_shard {d.dp_shard} x cp {d.cp} x tp {d.tp}")
        if self.resumed_from is not None:
            logger.message(f"checkpoint: resumed from {self.resumed_from} at step {self.step}")
        elif cfg.checkpoint.load == AUTO_LOAD:
            logger.message(f"checkpoint: load auto found no checkpoint in {save_dir(cfg)}; starting fresh")
        startup = " | ".join(f"{k} {v:.2f}s" for k, v in self.timers.startup.items())
        logger.message(f"startup: {startup} | peak {self.peak_flops / 1e9:.1f} GFLOP/s ({self.peak_flops_source})")
        logger.log(self.step, {f"startup_{k}_s": v for k, v in self.timers.startup.items()}, kind="startup", echo=False)

    def _loop(self, logger: MetricsLogger) -> None:
        t, every = self.cfg.train, save_interval(self.cfg)
        window: list[StepResult] = []
        window_time = 0.0
        first_step = self.step
        while self.step < t.train_iters:
            clock = self._compute_clock()
            with self.timers.phase("data"):
                batch = self.loader.next_global_batch()
            with self.profiler.step(self.step + 1):
                result = self._guarded_step(batch)
            compute_s = self._compute_clock() - clock
            phases = self.timers.end_step(self.step - first_step - 1)
            interval = self.cfg.parallel.straggler_interval
            if self.mesh is not None and interval and self.step % interval == 0:
                self._report_stragglers(logger, compute_s)
            self.history.append(result)
            self._account_nonfinite(result, logger)
            window.append(result)
            window_time += sum(phases.values())
            logger.advance(1, None if result.skipped else result.loss)
            if self.step % self.cfg.logger.log_interval == 0 or self.step == t.train_iters:
                logger.log(self.step, self._window_metrics(window, window_time, phases))
                if self.moe_details:
                    logger.log(self.step, self.moe_details, kind="moe", echo=False)
                window, window_time = [], 0.0
            if t.eval_interval and self.step % t.eval_interval == 0:
                self._evaluate_and_log(logger)
            if every and self.step % every == 0:
                with self._guard("checkpoint save at step", self.step):
                    self.save()
            if self.should_stop():
                break
        averages = self.timers.averages()
        if averages:
            logger.message("step phases (mean, first step excluded): "
                           + " | ".join(f"{k} {v * 1e3:.1f} ms" for k, v in averages.items()))

    def _evaluate_and_log(self, logger: MetricsLogger) -> None:
        with self._guard("evaluation after step", self.step):
            metrics = self.evaluate()
        if metrics is not None:
            logger.log(self.step, metrics, kind="valid")
            self.last_valid = (self.step, metrics["loss"])

    def _window_metrics(self, window: list[StepResult], seconds: float, phases: dict[str, float]) -> dict[str, Any]:
        good = [r for r in window if not r.skipped]
        tokens = sum(r.num_tokens for r in window)
        tokens_per_s = tokens / seconds if seconds > 0 else 0.0
        return {
            "loss": sum(r.loss for r in good) / len(good) if good else float("nan"),
            "lr": window[-1].lr,
            "grad_norm": window[-1].grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / (self.peak_flops * self.dims.world_size),
            "step_ms": 1e3 * seconds / len(window),
            "skipped": self.num_skipped,
            **interval_peak_memory(self.device),   # CUDA only: the interval's peak allocated memory
            # separately logged losses (MTP depths, issue 4), averaged like the loss
            **{k: sum(r.extra[k] for r in good) / len(good) for k in (good[-1].extra if good else {})},
        }
