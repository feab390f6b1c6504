"""The single-process training loop: build everything from a `RunConfig`, then repeat
data -> forward/backward over micro-batches -> clip -> optimizer step -> metrics -> eval -> checkpoint.

The loss of a global batch is the sum of token losses over all its micro-batches divided by the
number of loss tokens in the whole batch, so accumulation gives the same gradient as one big batch.
"""

from __future__ import annotations

import math
import random
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import yaml

from meshtron.checkpoint import CheckpointManager, load_checkpoint
from meshtron.config.loader import config_to_dict, save_config
from meshtron.config.schema import RunConfig
from meshtron.data.build import build_datasets
from meshtron.data.loader import BatchLoader, fixed_batches
from meshtron.data.tokenizer import build_tokenizer
from meshtron.models.gpt import GPTModel, count_parameters, flops_per_token
from meshtron.nn.context import PackedContext
from meshtron.nn.loss import masked_cross_entropy
from meshtron.training.flops import measure_matmul_flops
from meshtron.training.lr_schedule import LRSchedule
from meshtron.training.metrics import MetricsLogger
from meshtron.training.optimizer import build_optimizer
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
        self.cfg, self.timers = cfg, Timers()
        t = cfg.train
        if t.num_threads is not None:
            torch.set_num_threads(t.num_threads)
        self.device = resolve_device(t.device)
        self.run_dir = Path(t.run_dir)
        seed_everything(t.seed)
        with self.timers.startup_phase("data"):
            self.tokenizer = build_tokenizer(cfg.tokenizer)
            self.train_ds, self.valid_ds, _ = build_datasets(cfg, self.tokenizer)
            self.loader = BatchLoader(self.train_ds, micro_batch_size=t.micro_batch_size,
                                      global_batch_size=t.global_batch_size, seed=cfg.data.seed)
        with self.timers.startup_phase("model"):
            self.model = GPTModel(cfg.model, self.tokenizer.vocab_size).to(self.device)
            self.optimizer = build_optimizer(self.model, cfg.optimizer)
            self.schedule = LRSchedule(cfg.optimizer.lr, cfg.scheduler, t.train_iters)
        self.num_params = count_parameters(cfg.model, self.tokenizer.vocab_size)
        self.flops_per_token = flops_per_token(cfg.model, self.tokenizer.vocab_size, cfg.data.seq_length)
        self.step = 0
        self.nonfinite_in_a_row = 0
        self.num_skipped = 0
        self.history: list[StepResult] = []
        self.checkpoints = CheckpointManager(cfg.checkpoint.save or self.run_dir / "checkpoints",
                                             cfg.checkpoint.keep_last, cfg.checkpoint.async_save)
        if cfg.checkpoint.load:
            with self.timers.startup_phase("checkpoint_load"):
                self.load(cfg.checkpoint.load)
        with self.timers.startup_phase("peak_flops"):
            self.peak_flops = t.peak_flops or measure_matmul_flops(
                self.device, torch.bfloat16 if (t.precision == "bf16" and self.device.type == "cuda") else torch.float32)
        self.echo = echo

    # ---- one optimizer step -------------------------------------------------------------------

    def _autocast(self):
        if self.cfg.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _forward_loss(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        mb = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
        ctx = PackedContext.for_tokens(mb["input_ids"], mb.get("document_ids"), mb.get("position_ids"))
        with self._autocast():
            logits = self.model(mb["input_ids"], ctx)
        return masked_cross_entropy(logits, mb["labels"], mb["loss_mask"])

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """Accumulate gradients over the micro-batches, clip, and step unless anything is non-finite."""
        self.model.train()
        lr = self.schedule(self.step + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total_tokens = sum(float(mb["loss_mask"].sum()) for mb in micro_batches)
        loss_sum = 0.0
        with self.timers.phase("forward_backward"):
            for i, mb in enumerate(micro_batches):
                loss, _ = self._forward_loss(mb)
                if i == 0 and (self.step + 1) in self.cfg.train.debug_nonfinite_steps:
                    loss = loss * float("nan")
                (loss / max(total_tokens, 1.0)).backward()
                loss_sum += loss.item()
        with self.timers.phase("optimizer"):
            clip = self.cfg.optimizer.clip_grad if self.cfg.optimizer.clip_grad > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
            mean_loss = loss_sum / max(total_tokens, 1.0)
            skipped = not (math.isfinite(mean_loss) and math.isfinite(grad_norm))
            if not skipped:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepResult(self.step, mean_loss, grad_norm, lr, int(total_tokens), skipped)

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
        batches = fixed_batches(self.valid_ds, self.cfg.train.micro_batch_size, self.cfg.train.eval_iters)
        if not batches:
            return None
        self.model.eval()
        loss_sum = tokens = 0.0
        for mb in batches:
            loss, n = self._forward_loss(mb)
            loss_sum += loss.item()
            tokens += float(n)
        loss = loss_sum / max(tokens, 1.0)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}

    # ---- checkpoints ---------------------------------------------------------------------------

    def trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "data": self.loader.state_dict(), "rng": rng_state(),
                "schedule": self.schedule.state_dict(), "nonfinite_in_a_row": self.nonfinite_in_a_row,
                "num_skipped": self.num_skipped}

    def save(self) -> None:
        self.checkpoints.save(self.step, self.model, self.optimizer, self.trainer_state(),
                              yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False))

    def load(self, path: str | Path) -> None:
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step = int(state["step"])
        self.loader.load_state_dict(state["data"])
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.num_skipped = int(state.get("num_skipped", 0))
        set_rng_state(state["rng"])

    # ---- the loop ------------------------------------------------------------------------------

    def train(self) -> list[StepResult]:
        cfg, t = self.cfg, self.cfg.train
        save_config(cfg, self.run_dir / "config.yaml")
        logger = MetricsLogger(cfg.logger, self.run_dir, t.train_iters, config_to_dict(cfg), initial_step=self.step)
        try:
            self._announce(logger)
            self._loop(logger)
            if cfg.checkpoint.save_at_end and (cfg.checkpoint.save_interval == 0 or self.step % cfg.checkpoint.save_interval):
                self.save()
            self.checkpoints.wait()
        finally:
            logger.close()
        return self.history

    def _announce(self, logger: MetricsLogger) -> None:
        cfg = self.cfg
        logger.message(f"model: {self.num_params / 1e6:.2f}M parameters, pattern '{cfg.model.pattern}', "
                       f"vocab {self.model.vocab_size}, device {self.device.type}, {cfg.train.precision}")
        logger.message(f"data: {len(self.train_ds)} train / {len(self.valid_ds)} valid samples of "
                       f"{cfg.data.seq_length} tokens; global batch {cfg.train.global_batch_size} "
                       f"({self.loader.num_micro_batches} micro-batches of {cfg.train.micro_batch_size})")
        startup = " | ".join(f"{k} {v:.2f}s" for k, v in self.timers.startup.items())
        logger.message(f"startup: {startup} | peak {self.peak_flops / 1e9:.1f} GFLOP/s")
        logger.log(self.step, {f"startup_{k}_s": v for k, v in self.timers.startup.items()}, kind="startup", echo=False)

    def _loop(self, logger: MetricsLogger) -> None:
        t, ck = self.cfg.train, self.cfg.checkpoint
        window: list[StepResult] = []
        window_time = 0.0
        first_step = self.step
        while self.step < t.train_iters:
            with self.timers.phase("data"):
                batch = self.loader.next_global_batch()
            result = self.train_step(batch)
            phases = self.timers.end_step(self.step - first_step - 1)
            self.history.append(result)
            self._account_nonfinite(result, logger)
            window.append(result)
            window_time += sum(phases.values())
            logger.advance(1, None if result.skipped else result.loss)
            if self.step % self.cfg.logger.log_interval == 0 or self.step == t.train_iters:
                logger.log(self.step, self._window_metrics(window, window_time, phases))
                window, window_time = [], 0.0
            if t.eval_interval and self.step % t.eval_interval == 0:
                metrics = self.evaluate()
                if metrics is not None:
                    logger.log(self.step, metrics, kind="valid")
            if ck.save_interval and self.step % ck.save_interval == 0:
                self.save()
        averages = self.timers.averages()
        if averages:
            logger.message("step phases (mean, first step excluded): "
                           + " | ".join(f"{k} {v * 1e3:.1f} ms" for k, v in averages.items()))

    def _window_metrics(self, window: list[StepResult], seconds: float, phases: dict[str, float]) -> dict[str, Any]:
        good = [r for r in window if not r.skipped]
        tokens = sum(r.num_tokens for r in window)
        tokens_per_s = tokens / seconds if seconds > 0 else 0.0
        return {
            "loss": sum(r.loss for r in good) / len(good) if good else float("nan"),
            "lr": window[-1].lr,
            "grad_norm": window[-1].grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / self.peak_flops,
            "step_ms": 1e3 * seconds / len(window),
            "skipped": self.num_skipped,
        }
