"""The GRPO loop on the trainer (`meshtron.training.trainer.Trainer`): the policy is built, sharded
and stepped by the trainer's own machinery (ParallelDims and its mesh; pipeline stages, TP, EP,
activation checkpointing, compile, FSDP/HSDP; accumulate, clip, non-finite skipping, watchdog,
timers, profiler ranges, checkpoints). GRPO adds rollouts and its objective. Each step:
    rollouts (engine, in process) -> rewards -> advantages -> suspend the engine -> K optimizer steps
    (each one `Trainer.train_step` over a mini-batch, the GRPO loss as the objective) -> metrics ->
    eval -> checkpoint.

Rollouts. In one process the engine runs the trained model itself. With tensor parallelism alone
(parallel.tp = the number of processes) the engine runs the TP-sharded policy: TP rank 0 leads, the
others follow its forwards (`rl.inference.TensorParallelEngineBackend` on
`inference.tp_serving.TPGroup`), so every rank gets the same rollouts;
the policy is then built without sequence parallelism (the engine's decode steps hold one token).
Under pipeline parallelism (one stage per pp rank) the rollouts come from the pipeline-parallel engine
(`rl.inference.PipelineEngineBackend`): each rank keeps a copy of its own trained stage only, gathered
whole before rollouts, and the pp ranks' prompts go through the stages together.
Under every other layout (and with virtual pipeline stages) each rank keeps a whole rollout model,
copied from the sharded policy one tensor at a time before rollouts (rl/policy.py). The ranks that
share a data-parallel index (tp, cp, pp) split its prompts and all-gather the rollouts. Refused: router replay with pp, and
rl.backend other than engine with tp or pp (see `check_layout`).

The objective's losses carry global normalisers (token weights divided by the mini-batch's
completion tokens or sequences over every rank), so the trainer divides their sum by 1
(`loss_normaliser`). `step` counts GRPO steps; the trainer's own step counter counts optimizer steps
(`optimizer_steps`), which the learning-rate schedule follows.

The RL state saved in a checkpoint: model, optimizer, GRPO step and optimizer-step counts, the
position in the prompt stream, RNG states and (with a KL penalty) the reference weights. Rollout
seeds derive from (seed, step, prompt, sample), so a resumed run draws the same rollouts.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from meshtron.checkpoint import load_checkpoint, trainer_state_errors
from meshtron.config.fields import ConfigError
from meshtron.config.loader import config_to_dict, save_config
from meshtron.config.schema import RunConfig, SchedulerConfig
from meshtron.data.tokenizer import build_tokenizer
from meshtron.inference.request import SamplingParams
from meshtron.models.gpt import GPTModel
from meshtron.nn.moe.replay import clear_replay
from meshtron.parallel.parts import ModelParts
from meshtron.parallel.watchdog import Watchdog
from meshtron.rl.environments import build_environment
from meshtron.rl.grpo import (
    SUM_STATS,
    all_reduce,
    assign_advantages,
    forward_log_probs,
    grpo_loss,
    log_probs_of,
    split_mini_batches,
    supervised_loss,
    train_sequences,
)
from meshtron.rl.inference import InferenceBackend, build_backend, engine_config
from meshtron.rl.loss import PolicyLossConfig, token_weights, zero_variance_fraction
from meshtron.rl.packing import TrainSequence, micro_batches, pack_sequences
from meshtron.rl.policy import frozen_copy, gather_objects, gather_weights
from meshtron.rl.rollout import EvaluationAgent, GroupedRollouts, PassAtKEvaluator, RolloutGenerator, pass_at_k
from meshtron.training.interrupt import signal_name
from meshtron.training.lr_schedule import LRSchedule
from meshtron.training.metrics import MetricsLogger, format_duration
from meshtron.training.optimizer import build_optimizer
from meshtron.training.run_dir import save_interval
from meshtron.training.trainer import StepResult, Trainer, rng_state, set_rng_state

CURVE_FIELDS = ("step", "reward_mean", "reward_std", "greedy_success", "pass_at_k")


def check_layout(cfg: RunConfig) -> None:
    """The layouts RL refuses, each in one line naming the fields and why."""
    p, rl = cfg.parallel, cfg.rl
    if (p.tp > 1 or p.pp > 1) and rl.backend != "engine":
        which = f"parallel.tp={p.tp}" if p.tp > 1 else f"parallel.pp={p.pp}"
        raise ConfigError(f"rl.backend: {rl.backend} is not allowed with {which}; "
                          "parallel rollouts come from the in-process engine: set rl.backend engine")
    if p.pp > 1 and rl.router_replay and cfg.model.num_moe_experts:
        raise ConfigError("rl.router_replay: routing replay is not supported with parallel.pp > 1 yet; "
                          "set rl.router_replay false")


class _Unlogged:
    """The logger of steps taken outside `train()` (a caller stepping `grpo_step` itself)."""

    def log(self, *args, **kwargs) -> None:
        pass


class GRPOTrainer(Trainer):
    """The GRPO loop. `backend`, `rollouts` and `evaluator` replace the shipped inference backend
    (`build_backend` of rl.inference), rollout generator (`GroupedRollouts`) and evaluation agent
    (`PassAtKEvaluator`); `backend` may be a callable (model, tokenizer) -> backend, to sample the
    rollout model."""

    def __init__(self, cfg: RunConfig, *, backend: Union[InferenceBackend, Callable, None] = None,
                 rollouts: Optional[RolloutGenerator] = None, evaluator: Optional[EvaluationAgent] = None):
        rl = cfg.rl
        check_layout(cfg)
        self.ref_model: Optional[torch.nn.Module] = None
        self.ref_parts: Optional[list[torch.nn.Module]] = None  # under pp: the reference model's stages
        self.optimizer_steps = self.consumed_prompts = 0
        self.warmup_done = rl.warmup_steps == 0
        self.mode = "grpo"  # the objective: "grpo" or "supervised" (the warm-up)
        self.loss_cfg = PolicyLossConfig(rl.clip_eps_low, rl.clip_eps_high, rl.kl_beta, rl.entropy_coef,
                                         rl.is_truncation)
        self.stats: dict[int, dict[str, torch.Tensor]] = {}  # the step's micro-batch statistics, by index
        self.logger: Optional[MetricsLogger] = None
        super().__init__(cfg)
        # under pp the shipped engine runs as a pipeline: each rank holds a copy of its own stage only
        self.pipeline_engine = (backend is None and self.pipeline is not None and rl.backend == "engine"
                                and cfg.parallel.pp_virtual_stages == 1)
        self.rollout_model, self.replica_sync = self._build_rollout_model()
        if backend is None and self.tp_engine:
            backend = self._tensor_parallel_backend()
        elif self.pipeline_engine:
            backend = self._pipeline_backend()
        elif backend is None:
            backend = build_backend(cfg, self.rollout_model, self.tokenizer, self.device)
        elif callable(backend) and not hasattr(backend, "generate"):
            backend = backend(self.rollout_model, self.tokenizer)
        self.backend: InferenceBackend = backend
        self.rollouts: RolloutGenerator = rollouts or GroupedRollouts(rl.group_size)
        if self.rollouts.group_size != rl.group_size:
            raise ConfigError(f"rl.group_size: {rl.group_size} differs from the rollout generator's group_size "
                              f"({self.rollouts.group_size}); make them equal")
        self.evaluator: EvaluationAgent = evaluator or PassAtKEvaluator(
            rl.max_new_tokens, rl.eval_samples, rl.eval_k, rl.eval_temperature, seed=cfg.train.seed)
        self.history: list[dict[str, Any]] = []

    # ---- what the trainer builds differently for RL ---------------------------------------------

    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        d = self.dims  # tensor parallelism alone: the engine runs the sharded policy (leader and followers)
        self.tp_engine = d.world_size > 1 and d.tp == d.world_size
        if self.tp_engine:  # the engine's forwards of one decode token cannot be split along the sequence
            self.cfg.parallel.sequence_parallel = False

    def _build_data(self) -> None:
        """No token dataset: the tokenizer, the environment and its problems."""
        cfg, rl = self.cfg, self.cfg.rl
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.env = build_environment(cfg.env)
        self.train_problems = self.env.get_dataset("train", cfg.env.train_size, seed=cfg.train.seed)
        self.eval_problems = self.env.get_dataset("eval", rl.eval_problems, seed=cfg.train.seed)
        d = self.dims
        self.dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None else 0
        # the ranks sharing a data-parallel index split its prompts (the TP engine generates them once)
        self.share_axes = [] if self.tp_engine else [a for a in ("tp", "cp", "pp") if getattr(d, a) > 1]
        self.num_shares = 1
        self.share_rank = 0
        for axis in reversed(self.share_axes):  # (pp, cp, tp) order, tp innermost
            self.num_shares *= getattr(d, axis)
            self.share_rank = self.share_rank * getattr(d, axis) + self.mesh[axis].get_local_rank()
        n = d.dp * self.num_shares
        for name in ("prompts_per_step", "eval_problems"):
            if getattr(rl, name) % n:
                raise ConfigError(f"rl.{name}: {getattr(rl, name)} is not allowed; must be a multiple of the number "
                                  f"of ranks generating rollouts ({n})")

    def build_pipeline(self, model: GPTModel):
        from meshtron.parallel.pipeline import build_pipeline

        pipeline = build_pipeline(model, self.mesh, self.dims, self.cfg, self.device, check_micro_batches=False)
        pipeline.objective = self._pipeline_objective
        return pipeline

    def extend_model(self, model: GPTModel) -> None:
        if self.cfg.rl.init_checkpoint:
            load_checkpoint(self.cfg.rl.init_checkpoint, model)

    def _build_model(self) -> None:
        super()._build_model()
        rl = self.cfg.rl  # the schedule runs over optimizer steps: updates_per_step per GRPO step
        self.schedule = LRSchedule(self.cfg.optimizer.lr, self.cfg.scheduler, self.cfg.train.train_iters * rl.updates_per_step)

    @property
    def train_model(self) -> torch.nn.Module:
        """What the optimizer steps and checkpoints hold (under pp: this rank's stages)."""
        return self.model

    def _build_rollout_model(self):
        """(the engine's model, the pp replica sync or None): the policy itself in one process or
        under TP alone, else a whole copy kept in sync by `_sync`."""
        if self.mesh is None or self.tp_engine:
            return self.model, None
        if self.pipeline_engine:  # this rank's stage only, copied from the trained one by `_sync`
            self.rollout_stage = self._rollout_stage()
            return self.rollout_stage.part, None
        with torch.random.fork_rng(devices=[]):  # the same random stream as the single process afterwards
            model = GPTModel(self.cfg.model, self.tokenizer.vocab_size).to(self.device)
        sync = None
        if self.pipeline is not None:
            from meshtron.rl.pipeline import ReplicaSync

            owned = {name for name in gather_weights(self.model, model)}
            sync = ReplicaSync(model, owned, self.mesh["pp"].get_group())
        return model, sync

    def _sync(self) -> None:
        """Bring the rollout model up to date with the trained policy (a collective on every rank)."""
        if self.rollout_model is self.model:
            return
        with self._phase("rollout_sync"):
            gather_weights(self.model, self.rollout_model)
            if self.replica_sync is not None:
                self.replica_sync()

    def _rollout_stage(self):
        """The pipeline engine's stage of this rank (the training split, one stage per rank), holding a
        copy of the trained stage's weights (gathered whole where they are sharded)."""
        from meshtron.inference.pipeline_engine import empty_stage
        from meshtron.parallel.pipeline_stages import split_layers

        p = self.cfg.parallel
        ranges = split_layers(len(self.cfg.model.pattern), self.dims.pp, p.pp_first_stage_sublayers,
                              p.pp_last_stage_sublayers)
        with torch.random.fork_rng(devices=[]):  # the same random stream as the single process afterwards
            stage = empty_stage(self.cfg.model, self.tokenizer.vocab_size, ranges, self.mesh["pp"].get_local_rank(),
                                self.device)
        stage.requires_grad_(False)
        gather_weights(self.model, stage.part)
        return stage

    def _pipeline_backend(self) -> InferenceBackend:
        from meshtron.rl.inference import PipelineEngineBackend

        return PipelineEngineBackend(self.rollout_stage, self.tokenizer, engine_config(self.cfg, self.device),
                                     pp_group=self.mesh["pp"].get_group(), timeout_s=self.cfg.parallel.timeout_s)

    def _tensor_parallel_backend(self) -> InferenceBackend:
        from meshtron.inference.tp_serving import TPGroup
        from meshtron.rl.inference import TensorParallelEngineBackend
        from meshtron.rl.replay import has_routers

        rl, tp = self.cfg.rl, self.mesh["tp"]  # the tp group's rank 0 leads; no pings: the group carries the model's collectives too
        return TensorParallelEngineBackend(self.model, self.tokenizer, engine_config(self.cfg, self.device),
                                           TPGroup(tp.get_group(), leader=0),
                                           record_routing=rl.router_replay and has_routers(self.model))

    # ---- the objective the trainer's accumulate/step runs -----------------------------------------

    def loss_normaliser(self, micro_batches: list[dict[str, torch.Tensor]]) -> float:
        return 1.0  # the token weights already divide by the mini-batch's global totals

    def _local_micro_batch(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return mb  # `_policy_batches` already made them local (the old log probs need the local tokens)

    def _loss_context(self):
        return nullcontext()  # vocabulary-parallel log probs reduce over tp themselves (parallel/loss.py)

    def _forward_loss(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The objective of one local micro-batch (no pipeline): GRPO's policy loss or the warm-up's
        cross-entropy, a weighted sum; its statistics are kept for the step's metrics."""
        ctx = self._context(mb)
        with self._autocast():
            if self.mode == "supervised":
                loss, stats = supervised_loss(self.model(mb["input_ids"], ctx), mb)
            else:
                log_probs, entropy = forward_log_probs(self.model, mb, self.cfg.rl.temperature,
                                                       entropy_grad=self.cfg.rl.entropy_coef > 0, ctx=ctx)
                ref = None
                if self.ref_model is not None and self.cfg.rl.kl_beta > 0:
                    with torch.no_grad():
                        ref = forward_log_probs(self.ref_model, mb, self.cfg.rl.temperature, ctx=self._context(mb))[0]
                loss, stats = grpo_loss(log_probs, entropy, mb, self.loss_cfg, ref)
        self.stats[len(self.stats)] = stats
        return loss, stats["tokens"], {}

    def _pipeline_objective(self, logits: torch.Tensor, mb: dict[str, torch.Tensor], i: int) -> torch.Tensor:
        """The last stage's objective of micro-batch i (pipeline parallelism)."""
        if self.mode == "supervised":
            loss, stats = supervised_loss(logits, mb)
        else:
            log_probs, entropy = log_probs_of(logits, mb["labels"], self.cfg.rl.temperature,
                                              entropy_grad=self.cfg.rl.entropy_coef > 0)
            loss, stats = grpo_loss(log_probs, entropy, mb, self.loss_cfg, mb.get("ref_log_probs"))
        self.stats[i] = stats  # (the stage's shape inference calls this once for 0; the schedule overwrites it)
        return loss

    @contextmanager
    def _optimizer_counters(self, optimizer, schedule, steps: int) -> Iterator[None]:
        """Inside, the trainer's step counter, optimizer and schedule are those of the optimizer steps
        being taken (`steps` done so far); GRPO's own step counter is restored after."""
        saved = self.step, self.optimizer, self.schedule
        self.step, self.optimizer, self.schedule = steps, optimizer, schedule
        try:
            yield
        finally:
            self.step, self.optimizer, self.schedule = saved

    def _policy_step(self, batch: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step of the trainer over a mini-batch's local micro-batches."""
        self.stats = {}
        with self._optimizer_counters(self.optimizer, self.schedule, self.optimizer_steps):
            result = self._guarded_step(batch)
            self.optimizer_steps = self.step
        clear_replay(self.model)  # entries kept for a backward recompute (none without checkpointing)
        self._account(result)
        return result

    def _account(self, result: StepResult) -> None:
        """The trainer's non-finite bookkeeping (stops after train.max_nonfinite_steps in a row)."""
        self._account_nonfinite(result, self.logger or _Unlogged())

    def _policy_batches(self, sequences: list[TrainSequence]) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Packed rows -> (local micro-batches: on the device, this rank's part under CP, padded to the
        schedule's fixed shape under pp; how many of them are real)."""
        rows = pack_sequences(sequences, self.cfg.rl.pack_length, self.tokenizer.pad_id)
        mbs = micro_batches(rows, self.cfg.train.micro_batch_size)
        real = target = len(mbs)
        if self.dims.dp > 1:  # every data-parallel rank runs as many forwards (FSDP gathers in each)
            target = int(all_reduce([float(real)], dist.ReduceOp.MAX, self.group("dp"))[0])
        if self.pipeline is not None or target > real:
            # padded before the CP split: a padding row is a whole sequence of its own
            from meshtron.rl.pipeline import pad_micro_batches

            pipelined = self.pipeline is not None
            mbs = pad_micro_batches(mbs, self.cfg.train.micro_batch_size if pipelined else None,
                                    self.dims.pp, at_least=target)
        return [Trainer._local_micro_batch(self, mb) for mb in mbs], real

    @torch.no_grad()
    def _log_probs(self, parts: torch.nn.Module, batch: list[dict[str, torch.Tensor]], key: str) -> None:
        """mb[key] = token log probs of `parts` (the policy or the frozen reference) for every micro-batch."""
        temperature = self.cfg.rl.temperature
        if self.pipeline is not None:
            def keep(logits: torch.Tensor, i: int) -> None:
                batch[i][key] = log_probs_of(logits, batch[i]["labels"], temperature)[0]

            self.pipeline.forward_only(list(parts), batch, keep)
            return
        for mb in batch:
            with self._autocast():
                mb[key] = forward_log_probs(parts, mb, temperature, ctx=self._context(mb))[0]

    def _reduce_stats(self, stats: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Sum the step's statistics over every rank (each holds those of its own tokens; the ranks of
        a TP group hold the same ones) -> the step's metrics, the same on every rank."""
        values = self._sum_over_data([sum(float(s[k]) for s in stats) for k in SUM_STATS])
        mx = max([float(s["is_weight_max"]) for s in stats], default=-float("inf"))
        mn = min([float(s["is_weight_min"]) for s in stats], default=float("inf"))
        mx = all_reduce([mx], dist.ReduceOp.MAX)[0] if dist.is_initialized() else mx
        mn = all_reduce([mn], dist.ReduceOp.MIN)[0] if dist.is_initialized() else mn
        out = dict(zip(SUM_STATS, values))
        n = max(out["tokens"], 1.0)
        return {"kl": out["kl"] / n, "entropy": out["entropy"] / n,
                "clip_fraction": (out["clipped_low"] + out["clipped_high"]) / n,
                "clip_fraction_low": out["clipped_low"] / n, "clip_fraction_high": out["clipped_high"] / n,
                "ratio_mean": out["ratio"] / n, "is_weight_mean": out["is_weight"] / n, "is_weight_max": mx,
                "is_weight_min": mn, "logprob_gap": out["logprob_gap"] / n}

    # ---- phases --------------------------------------------------------------------------------

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.cfg.rl.max_new_tokens, temperature=self.cfg.rl.temperature)

    def warmup(self, logger: MetricsLogger) -> None:
        """Supervised steps on the environment's demonstrations (prompt -> solution + end of document)."""
        rl, t = self.cfg.rl, self.cfg.train
        optimizer = build_optimizer(self.model, dataclasses.replace(self.cfg.optimizer, lr=rl.warmup_lr))
        schedule = LRSchedule(rl.warmup_lr, SchedulerConfig(warmup_steps=min(10, rl.warmup_steps), decay_style="cosine",
                                                             min_lr=rl.warmup_lr * 0.1), rl.warmup_steps)
        problems = self.env.get_dataset("train", rl.warmup_steps * rl.warmup_batch_size, seed=t.seed + 1)
        local = rl.warmup_batch_size // self.dims.dp
        eod = self.tokenizer.eod_id
        self.mode = "supervised"
        try:
            for step in range(1, rl.warmup_steps + 1):
                start = (step - 1) * rl.warmup_batch_size + self.dp_rank * local
                batch = [problems[i] for i in range(start, start + local)]
                prompts = [self.tokenizer.encode(self.env.get_prompt(p)) for p in batch]
                answers = [self.tokenizer.encode(p.solution) + [eod] for p in batch]
                total = all_reduce([float(sum(map(len, answers)))], group=self.group("dp"))[0]
                weights = token_weights([len(a) for a in answers], "token_mean", rl.max_new_tokens, int(total))
                seqs = [TrainSequence(p + a, len(p), w) for p, a, w in zip(prompts, answers, weights)]
                self.stats = {}
                with self._optimizer_counters(optimizer, schedule, step - 1):
                    result = self._guarded_step(self._policy_batches(seqs)[0])
                self._account(result)
                correct, tokens = self._sum_over_data([sum(float(s[k]) for s in self.stats.values())
                                                       for k in ("correct", "tokens")])
                metrics = {"loss": result.loss, "token_accuracy": correct / max(tokens, 1.0),
                           "grad_norm": result.grad_norm, "lr": result.lr}
                if step % self.cfg.logger.log_interval == 0 or step == rl.warmup_steps:
                    logger.log(step, metrics, kind="warmup")
        finally:
            self.mode = "grpo"
        self.backend.suspend()  # the prefix cache holds keys/values of the weights before the warm-up
        self.warmup_done = True

    def _sum_over_data(self, values: list[float]) -> list[float]:
        """Sum over every rank, counting the tensor-parallel copies once."""
        return [v / self.dims.tp for v in all_reduce(values)]

    def evaluate(self) -> dict[str, float]:
        self._sync()
        workers, me = self.dims.dp * self.num_shares, self.dp_rank * self.num_shares + self.share_rank
        mine = [self.eval_problems[i] for i in range(me, len(self.eval_problems), workers)]
        out = self.evaluator.evaluate(self.backend, self.env, self.tokenizer, mine)
        keys = sorted(out)  # summed over every rank; under the TP engine a TP group evaluated its share once
        copies = self.dims.world_size // workers
        sums = [v / copies for v in all_reduce([out[k] * len(mine) for k in keys])]
        return {k: v / len(self.eval_problems) for k, v in zip(keys, sums)}

    def grpo_step(self) -> dict[str, float]:
        rl = self.cfg.rl
        local = rl.prompts_per_step // self.dims.dp
        first = self.consumed_prompts + self.dp_rank * local
        share = local // self.num_shares  # the ranks of a data-parallel index each generate a share
        mine = first + self.share_rank * share
        problems = [self.train_problems[(mine + i) % len(self.train_problems)] for i in range(share)]
        t0 = time.perf_counter()
        with self._guard("rollouts of step", self.step + 1), self._phase("rollouts"):
            self._sync()
            rollouts = self.rollouts.generate(self.backend, self.env, self.tokenizer, problems, self.sampling(),
                                              self.cfg.train.seed, self.step, first_group=mine)
            if len(rollouts) != len(problems) * rl.group_size:
                raise RuntimeError(f"the rollout generator returned {len(rollouts)} rollouts for {len(problems)} "
                                   f"prompts; it must return rl.group_size={rl.group_size} per prompt, groups consecutive")
            if self.share_axes:
                rollouts = gather_objects(rollouts, [self.mesh[a].get_group() for a in self.share_axes])
        rollout_s = time.perf_counter() - t0
        rewards = assign_advantages(rollouts, rl.group_size, rl.scale_advantages_by_std, rl.reward_clip)
        self.backend.suspend()  # frees the KV cache; the old weights' keys/values must not be reused
        t1 = time.perf_counter()
        metrics = self._update(split_mini_batches(rollouts, rl.updates_per_step, self.cfg.train.seed, self.step,
                                                  self.consumed_prompts, rl.prompts_per_step, rl.group_size))
        train_s = time.perf_counter() - t1
        self.consumed_prompts += rl.prompts_per_step
        self.step += 1
        self.timers.end_step(self.step - 1)
        return {**self._reward_metrics(rewards, rollouts), **metrics, "rollout_s": rollout_s, "train_s": train_s,
                "generation_share": rollout_s / (rollout_s + train_s)}

    def _update(self, mini_batches) -> dict[str, float]:
        """One optimizer step of the trainer per mini-batch; -> the step's statistics (global)."""
        rl = self.cfg.rl
        self.model.train()
        sequences = [train_sequences(mb, rl.aggregation, rl.max_new_tokens, self.group("dp")) for mb in mini_batches]
        num_tokens = all_reduce([float(sum(len(s.token_ids) - 1 for seqs in sequences for s in seqs))],
                                group=self.group("dp"))[0]
        batches, num_real = zip(*[self._policy_batches(seqs) for seqs in sequences])
        if len(batches) > 1:  # later mini-batches need the log probs of the weights that sampled them
            for b in batches:
                self._log_probs(self.model if self.pipeline is None else self.pipeline.parts, b, "old_log_probs")
        stats, results = [], []
        for batch, real in zip(batches, num_real):
            if self.ref_parts is not None and rl.kl_beta > 0:
                self._log_probs(self.ref_parts, batch, "ref_log_probs")
            results.append(self._policy_step(batch))
            stats += [self.stats[i] for i in range(real) if i in self.stats]  # under pp: on the last stage
        return {"loss": sum(r.loss for r in results) / len(results), "grad_norm": results[-1].grad_norm,
                "lr": results[-1].lr, "skipped_steps": float(sum(r.skipped for r in results)),
                **self._reduce_stats(stats), "train_tokens": num_tokens}

    def _reward_metrics(self, rewards: torch.Tensor, rollouts) -> dict[str, float]:
        g = self.cfg.rl.group_size
        success = [sum(r.reward >= 1.0 for r in rollouts[i:i + g]) for i in range(0, len(rollouts), g)]
        k = min(self.cfg.rl.eval_k, g)
        n, s, s2, zero_var, p1, pk, length = all_reduce(group=self.group("dp"), values=[
            float(len(rewards)), float(rewards.sum()), float((rewards ** 2).sum()),
            zero_variance_fraction(rewards, g) * len(success), sum(pass_at_k(g, c, 1) for c in success),
            sum(pass_at_k(g, c, k) for c in success), float(sum(len(r.completion_ids) for r in rollouts))])
        groups = n / g
        mean = s / n
        return {"reward_mean": mean, "reward_std": max(s2 / n - mean * mean, 0.0) ** 0.5,
                "zero_variance_groups": zero_var / groups, "pass@1": p1 / groups, f"pass@{k}": pk / groups,
                "completion_tokens_mean": length / n, "rollout_tokens": length}

    # ---- checkpoints ---------------------------------------------------------------------------

    def trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "optimizer_steps": self.optimizer_steps, "consumed_prompts": self.consumed_prompts,
                "warmup_done": self.warmup_done, "rng": rng_state(), "schedule": self.schedule.state_dict(),
                "nonfinite_in_a_row": self.nonfinite_in_a_row, "num_skipped": self.num_skipped,
                "ref_model": None if self.ref_model is None else self._ref_state()}

    def _ref_state(self) -> dict[str, torch.Tensor]:
        """The reference weights whole (shards gathered, pipeline stages collected: every rank loads its own part)."""
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.ref_model.state_dict().items()}
        if self.pipeline is not None:
            parts: list[Optional[dict]] = [None] * self.dims.pp
            dist.all_gather_object(parts, state, group=self.group("pp"))
            state = {k: v for part in parts for k, v in part.items()}
        return state

    def load(self, path: str | Path) -> None:
        state = load_checkpoint(path, self.model, self.optimizer)
        if state.get("model_only"):
            return
        with trainer_state_errors(path):  # a hand-edited trainer_state.json is one line, not a traceback
            self.step, self.optimizer_steps = int(state["step"]), int(state["optimizer_steps"])
            self.consumed_prompts, self.warmup_done = int(state["consumed_prompts"]), bool(state["warmup_done"])
            self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
            self.num_skipped = int(state.get("num_skipped", 0))
            if state.get("ref_model") is not None:
                self.ref_model = self._frozen_copy()
                with torch.no_grad():
                    for name, target in self.ref_model.state_dict().items():
                        value = state["ref_model"][name].to(self.device)
                        if isinstance(target, DTensor):
                            value = distribute_tensor(value, target.device_mesh, target.placements)
                            target.to_local().copy_(value.to_local())
                        else:
                            target.copy_(value)
            set_rng_state(state["rng"])

    def _frozen_copy(self) -> torch.nn.Module:
        """A frozen copy of the trained weights, placed like the policy (under pp: this rank's stages,
        kept in ref_parts)."""
        if self.mesh is None:
            return copy.deepcopy(self.model).eval().requires_grad_(False)
        stages = None
        if self.pipeline is not None:
            from meshtron.parallel.pipeline_stages import split_layers

            p = self.cfg.parallel
            stages = (split_layers(len(self.cfg.model.pattern), self.pipeline.num_stages, p.pp_first_stage_sublayers,
                                   p.pp_last_stage_sublayers), self.pipeline.stage_ids)
        parts = frozen_copy(self.model_parts, self.cfg, self.dims, self.mesh, self.tokenizer.vocab_size, self.device,
                            stages)
        if self.pipeline is None:
            return parts[0]
        self.ref_parts = parts
        return ModelParts(parts)

    # ---- the loop ------------------------------------------------------------------------------

    def train(self) -> list[dict[str, Any]]:
        cfg, rl = self.cfg, self.cfg.rl
        if self.rank == 0:
            save_config(cfg, self.run_dir / "config.yaml")
        logger = MetricsLogger(cfg.logger, self.run_dir, cfg.train.train_iters, config_to_dict(cfg),
                               initial_step=self.step, enabled=self.rank == 0)
        self.logger = logger
        early = cfg.parallel.timeout_s / 2 if self.device.type == "cuda" else None
        self.watchdog = Watchdog(self.run_dir, cfg.parallel.timeout_s, report_after_s=early) if self.mesh is not None else None
        started = self.started = time.perf_counter()
        try:
            self.stop.__enter__()   # SIGTERM/SIGINT: checkpoint at the next step boundary, then stop
            logger.message(f"model: {self.num_params / 1e6:.2f}M parameters, environment {'+'.join(cfg.env.names)}, "
                           f"{self.dims.world_size} process(es), "
                           f"{rl.prompts_per_step} prompts x {rl.group_size} samples per step")
            if not self.warmup_done:
                self.warmup(logger)
            if self.step == 0:
                with self._guard("evaluation before step", 1):
                    initial = self.evaluate()
                logger.log(0, initial, kind="eval")
                self._curve_row(0, None, initial)
            if rl.kl_beta > 0 and self.ref_model is None:
                self.ref_model = self._frozen_copy()
            self._loop(logger)
            if self.stopped_by is None:
                with self._guard("evaluation after step", self.step):
                    final = self.evaluate()
                logger.log(self.step, {**final, "wall_s": time.perf_counter() - started}, kind="eval")
                self._curve_row(self.step, None, final)
            self.finish(logger)
        finally:
            self.stop.__exit__()
            self.profiler.close()
            logger.close()
            self.logger = None
            if self.watchdog is not None:
                self.watchdog.close()
        return self.history

    def _loop(self, logger: MetricsLogger) -> None:
        cfg, interval = self.cfg, save_interval(self.cfg)
        while self.step < cfg.train.train_iters:
            with self.profiler.step(self.step + 1):
                metrics = self.grpo_step()
            self.history.append({"step": self.step, **metrics})
            logger.advance(1)
            evaluation = None
            if cfg.rl.eval_interval and self.step % cfg.rl.eval_interval == 0 and self.step < cfg.train.train_iters:
                with self._guard("evaluation after step", self.step):
                    evaluation = self.evaluate()
                logger.log(self.step, evaluation, kind="eval")
            if self.step % cfg.logger.log_interval == 0 or self.step == cfg.train.train_iters:
                logger.log(self.step, metrics)
            self._curve_row(self.step, metrics, evaluation)
            if interval and self.step % interval == 0:
                with self._guard("checkpoint save at step", self.step):
                    self.save()
            if self.should_stop():
                break
        averages = self.timers.averages()  # the trainer's phases of the optimizer steps (forward_backward, optimizer)
        if averages:
            logger.message("step phases (mean per GRPO step, first excluded): "
                           + " | ".join(f"{k} {v * 1e3:.1f} ms" for k, v in averages.items()))

    def write_curves(self, logger: MetricsLogger) -> None:
        """The reward curve (reward_curve.csv is written as the run goes; the PNG with the 'plot' extra)."""
        from meshtron.rl.plot import write_reward_plot

        csv_path = self.run_dir / "reward_curve.csv"
        if csv_path.is_file():
            png = write_reward_plot(csv_path, self.run_dir / "reward_curve.png")
            logger.message(f"reward curve: {png or csv_path}")

    def summary(self) -> str:
        """The end-of-run line: steps, time, the last step's mean reward, the checkpoint."""
        head = "done" if self.stopped_by is None else f"stopped by {signal_name(self.stopped_by)}"
        parts = [f"{head}: step {self.step}/{self.cfg.train.train_iters} in "
                 f"{format_duration(time.perf_counter() - self.started)}"]
        if self.history and "reward_mean" in self.history[-1]:
            parts.append(f"reward {self.history[-1]['reward_mean']:.4f}")
        path = self.checkpoint_path()
        parts.append(f"checkpoint {path}" if path is not None else "no checkpoint saved")
        return " | ".join(parts)

    def _curve_row(self, step: int, metrics: Optional[dict], evaluation: Optional[dict]) -> None:
        """Append to <run_dir>/reward_curve.csv: the step's reward and, when evaluated, held-out success."""
        if self.rank != 0:
            return
        path = self.run_dir / "reward_curve.csv"
        new = not path.exists()
        k = f"pass@{self.cfg.rl.eval_k}"
        with open(path, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(CURVE_FIELDS)
            row = [step, metrics["reward_mean"] if metrics else "", metrics["reward_std"] if metrics else "",
                   evaluation.get("greedy_success", "") if evaluation else "", evaluation.get(k, "") if evaluation else ""]
            writer.writerow(row)
