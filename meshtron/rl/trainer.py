"""The GRPO loop: build model, tokenizer, environment, rollout engine and optimizer from a `RunConfig`,
optionally warm up on demonstrations, then repeat
    rollouts (engine, in process) -> rewards -> advantages -> suspend the engine -> K optimizer steps
    -> (the engine resumes with an empty cache on the next rollouts) -> metrics -> eval -> checkpoint.

Under torchrun every data-parallel replica generates its share of the prompts with its own engine,
and the gradients are summed over replicas (the loss carries global normalisers), so the weights
stay identical. With parallel.tp > 1 a replica is a TP group holding one sharded model: its rank 0
leads the engine on the sharded model, the others follow its forwards (`TensorParallelEngineBackend`);
every rank trains on the same rollouts with vocabulary-parallel log probs. With parallel.pp > 1 a
replica is a pipeline: it trains through the pipeline schedules, and every pp rank keeps the whole
model for rollouts, synced from the stages' owners before each rollout phase; the pp ranks split
the replica's prompts and share their rollouts (`meshtron.rl.pipeline`). Context and expert
parallel layouts, and tp with pp, are refused.

The RL state saved in a checkpoint: model, optimizer, GRPO step and optimizer-step counts, the
position in the prompt stream, RNG states and (with a KL penalty) the reference weights. Rollout
seeds derive from (seed, step, prompt, sample), so a resumed run draws the same rollouts.
"""

from __future__ import annotations

import copy
import csv
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import yaml
from torch.distributed.tensor import DTensor, distribute_tensor

from meshtron.checkpoint import CheckpointManager, load_checkpoint, trainer_state_errors
from meshtron.config.fields import ConfigError
from meshtron.config.loader import config_to_dict, save_config
from meshtron.config.schema import RunConfig, SchedulerConfig
from meshtron.data.tokenizer import build_tokenizer
from meshtron.inference.request import SamplingParams
from meshtron.models.gpt import GPTModel, count_parameters
from meshtron.parallel.distributed import init_distributed
from meshtron.rl.environments import build_environment
from meshtron.rl.grpo import GRPOUpdate, all_reduce, assign_advantages, split_mini_batches, supervised_step
from meshtron.rl.inference import InferenceBackend, build_backend, engine_config
from meshtron.rl.loss import token_weights, zero_variance_fraction
from meshtron.rl.packing import TrainSequence
from meshtron.rl.rollout import EvaluationAgent, GroupedRollouts, PassAtKEvaluator, RolloutGenerator, pass_at_k
from meshtron.training.lr_schedule import LRSchedule
from meshtron.training.metrics import MetricsLogger
from meshtron.training.optimizer import build_optimizer
from meshtron.training.precision import enable_tf32, resolve_precision
from meshtron.training.resume import resolve_load, save_dir
from meshtron.training.trainer import resolve_device, rng_state, seed_everything, set_rng_state

CURVE_FIELDS = ("step", "reward_mean", "reward_std", "greedy_success", "pass_at_k")


class GRPOTrainer:
    """The GRPO loop. `backend`, `rollouts` and `evaluator` replace the shipped inference backend
    (`build_backend` of rl.backend), rollout generator (`GroupedRollouts`) and evaluation agent
    (`PassAtKEvaluator`); `backend` may be a callable (model, tokenizer) -> backend, to sample the
    trained model."""

    def __init__(self, cfg: RunConfig, *, backend: Union[InferenceBackend, Callable, None] = None,
                 rollouts: Optional[RolloutGenerator] = None, evaluator: Optional[EvaluationAgent] = None):
        self.cfg, rl, t = cfg, cfg.rl, cfg.train
        if t.num_threads is not None:
            torch.set_num_threads(t.num_threads)
        self.device = resolve_device(t.device)
        t.precision = resolve_precision(t.precision, self.device)   # auto: bf16 autocast on CUDA, fp32 on a CPU
        enable_tf32(self.device)
        self.run_dir = Path(t.run_dir)
        self._setup_distributed()
        seed_everything(t.seed)
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.env = build_environment(cfg.env)
        self.model = GPTModel(cfg.model, self.tokenizer.vocab_size).to(self.device)  # the rollout model
        if self.tp_mesh is not None:  # logits stay sharded over the vocabulary (vocab-parallel log probs)
            from meshtron.parallel.tensor_parallel import apply_tp

            apply_tp(self.model, self.tp_mesh, sequence_parallel=False, loss_parallel=True)
        if rl.init_checkpoint:
            load_checkpoint(rl.init_checkpoint, self.model)
        self.pipeline = self.sync_replica = None
        self.train_model: torch.nn.Module = self.model  # what the optimizer steps and checkpoints hold
        if self.pp > 1:
            self._build_pipeline()
        self.optimizer = build_optimizer(self.train_model, cfg.optimizer)
        self.schedule = LRSchedule(cfg.optimizer.lr, cfg.scheduler, t.train_iters * rl.updates_per_step)
        if backend is None and self.tp_mesh is not None:
            backend = self._tensor_parallel_backend()
        elif backend is None:
            backend = build_backend(cfg, self.model, self.tokenizer, self.device)
        elif callable(backend) and not hasattr(backend, "generate"):
            backend = backend(self.model, self.tokenizer)
        self.backend: InferenceBackend = backend
        self.rollouts: RolloutGenerator = rollouts or GroupedRollouts(rl.group_size)
        if self.rollouts.group_size != rl.group_size:
            raise ConfigError(f"rl.group_size: {rl.group_size} differs from the rollout generator's group_size "
                              f"({self.rollouts.group_size}); make them equal")
        self.evaluator: EvaluationAgent = evaluator or PassAtKEvaluator(
            rl.max_new_tokens, rl.eval_samples, rl.eval_k, rl.eval_temperature, seed=t.seed)
        self.ref_model: Optional[torch.nn.Module] = None
        self.ref_parts: Optional[list[torch.nn.Module]] = None  # under pp: the reference model's stages
        self.step = self.optimizer_steps = self.consumed_prompts = 0
        self.warmup_done = rl.warmup_steps == 0
        self.train_problems = self.env.get_dataset("train", cfg.env.train_size, seed=t.seed)
        self.eval_problems = self.env.get_dataset("eval", rl.eval_problems, seed=t.seed)
        self.checkpoints = CheckpointManager(save_dir(cfg), cfg.checkpoint.keep_last, cfg.checkpoint.async_save,
                                             timeout_s=cfg.parallel.timeout_s)
        load = resolve_load(cfg, self.device)  # checkpoint.load, or what `auto` found in the save directory
        if load is not None:
            self.load(load)
        self.history: list[dict[str, Any]] = []

    def _setup_distributed(self) -> None:
        """Ranks form (dp, tp) with tp innermost: rank = dp_rank * tp + tp_rank. Prompts are shared
        over dp; the ranks of a TP group hold one sharded model and the same rollouts. With pp > 1:
        `_setup_pipeline_groups`."""
        p = self.cfg.parallel
        for name in ("cp", "ep"):
            if getattr(p, name) != 1:
                raise ConfigError(f"parallel.{name}: {getattr(p, name)} is not allowed for meshtron rl; the rollout "
                                  "engine runs whole or tensor-parallel models: use data, tensor or pipeline parallelism")
        tp, pp = p.tp, p.pp
        if tp > 1 and pp > 1:
            raise ConfigError(f"parallel.pp: {pp} is not allowed with parallel.tp={tp} for meshtron rl; "
                              "use tensor or pipeline parallelism (with data parallelism), not both")
        if (tp > 1 or pp > 1) and self.cfg.rl.backend != "engine":
            which = f"parallel.tp={tp}" if tp > 1 else f"parallel.pp={pp}"
            raise ConfigError(f"rl.backend: {self.cfg.rl.backend} is not allowed with {which}; "
                              "parallel rollouts come from the in-process engine: set rl.backend engine")
        self.world_size = init_distributed(self.device, p.timeout_s)
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.pp, self.pp_rank, self.pp_group = 1, 0, None
        if pp > 1:
            self._setup_pipeline_groups(pp)
            return
        if self.world_size % tp:
            raise ConfigError(f"parallel.tp: {tp} is not allowed; must divide the number of processes ({self.world_size})")
        self.tp, self.dp_size, self.dp_rank = tp, self.world_size // tp, self.rank // tp
        self.dp_group = self.tp_group = self.tp_mesh = None
        if tp > 1:
            from datetime import timedelta

            from torch.distributed.device_mesh import DeviceMesh

            timeout = timedelta(seconds=p.timeout_s)
            for d in range(self.dp_size):  # every rank creates every group, in the same order
                group = dist.new_group(list(range(d * tp, (d + 1) * tp)), timeout=timeout)
                if d == self.dp_rank:
                    self.tp_group = group
            for r in range(tp):
                group = dist.new_group(list(range(r, self.world_size, tp)), timeout=timeout)
                if r == self.rank % tp:
                    self.dp_group = group
            self.tp_mesh = DeviceMesh.from_group(self.tp_group, self.device.type, mesh_dim_names=("tp",))
        self._check_prompt_counts()

    def _setup_pipeline_groups(self, pp: int) -> None:
        """The (pp, dp) mesh of `meshtron train` (pp outermost); gradients are summed over dp."""
        from meshtron.parallel.dims import ParallelDims

        if self.world_size % pp:
            raise ConfigError(f"parallel.pp: {pp} is not allowed; must divide the number of processes ({self.world_size})")
        self.dims = ParallelDims(dp_replicate=self.world_size // pp, dp_shard=1, cp=1, tp=1, pp=pp, ep=1,
                                 world_size=self.world_size)
        self.mesh = self.dims.build_mesh(self.device.type, self.cfg.parallel.timeout_s)
        self.tp, self.dp_size, self.dp_rank = 1, self.dims.dp, self.mesh["dp"].get_local_rank()
        self.dp_group = self.mesh["dp"].get_group()  # a real group even of one rank: None would mean every rank
        self.tp_group = self.tp_mesh = None
        self.pp, self.pp_rank, self.pp_group = pp, self.mesh["pp"].get_local_rank(), self.mesh["pp"].get_group()
        self._check_prompt_counts()

    def _check_prompt_counts(self) -> None:
        rl, n = self.cfg.rl, self.dp_size * self.pp  # every pp rank generates its own share
        for name in ("prompts_per_step", "eval_problems"):
            if getattr(rl, name) % n:
                what = "data-parallel replicas" if self.pp == 1 else "data-parallel replicas x pipeline ranks"
                raise ConfigError(f"rl.{name}: {getattr(rl, name)} is not allowed; must be a multiple of the number "
                                  f"of {what} ({n})")

    def _build_pipeline(self) -> None:
        """This rank's stages (sharing parameters with the full rollout model) and the replica sync."""
        from meshtron.parallel.parts import ModelParts
        from meshtron.parallel.pipeline import build_pipeline
        from meshtron.rl.pipeline import ReplicaSync, RLPipeline
        from meshtron.rl.replay import has_routers

        if self.cfg.rl.router_replay and has_routers(self.model):
            raise ConfigError("rl.router_replay: routing replay is not supported with parallel.pp > 1 yet; "
                              "set rl.router_replay false")
        self.pipeline = build_pipeline(self.model, self.mesh, self.dims, self.cfg, self.device, RLPipeline,
                                       check_micro_batches=False)
        self.train_model = ModelParts(self.pipeline.parts)
        self.sync_replica = ReplicaSync(self.model, set(self.train_model.state_dict()), self.pp_group)

    def _sync(self) -> None:
        """Under pp: bring the rollout model's other stages up to date (their owners trained them)."""
        if self.sync_replica is not None:
            self.sync_replica()

    def _tensor_parallel_backend(self) -> InferenceBackend:
        from meshtron.inference.tp_serving import TPGroup
        from meshtron.rl.inference import TensorParallelEngineBackend
        from meshtron.rl.replay import has_routers

        rl = self.cfg.rl  # the TP group's rank 0 leads; no pings: the group carries the model's collectives too
        return TensorParallelEngineBackend(self.model, self.tokenizer, engine_config(self.cfg, self.device),
                                           TPGroup(self.tp_group, leader=0),
                                           record_routing=rl.router_replay and has_routers(self.model))

    # ---- phases --------------------------------------------------------------------------------

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.cfg.rl.max_new_tokens, temperature=self.cfg.rl.temperature)

    def warmup(self, logger: MetricsLogger) -> None:
        """Supervised steps on the environment's demonstrations (prompt -> solution + end of document)."""
        rl, t = self.cfg.rl, self.cfg.train
        optimizer = build_optimizer(self.train_model, replace(self.cfg.optimizer, lr=rl.warmup_lr))
        schedule = LRSchedule(rl.warmup_lr, SchedulerConfig(warmup_steps=min(10, rl.warmup_steps), decay_style="cosine",
                                                             min_lr=rl.warmup_lr * 0.1), rl.warmup_steps)
        problems = self.env.get_dataset("train", rl.warmup_steps * rl.warmup_batch_size, seed=t.seed + 1)
        local = rl.warmup_batch_size // self.dp_size
        eod = self.tokenizer.eod_id
        for step in range(1, rl.warmup_steps + 1):
            start = (step - 1) * rl.warmup_batch_size + self.dp_rank * local
            batch = [problems[i] for i in range(start, start + local)]
            prompts = [self.tokenizer.encode(self.env.get_prompt(p)) for p in batch]
            answers = [self.tokenizer.encode(p.solution) + [eod] for p in batch]
            total = all_reduce([float(sum(map(len, answers)))], group=self.dp_group)[0]
            weights = token_weights([len(a) for a in answers], "token_mean", rl.max_new_tokens, int(total))
            seqs = [TrainSequence(p + a, len(p), w) for p, a, w in zip(prompts, answers, weights)]
            if self.pipeline is not None:
                from meshtron.rl.pipeline import pipeline_supervised_step

                metrics = pipeline_supervised_step(self.pipeline, self.train_model, optimizer, seqs, rl.pack_length,
                                                   self.tokenizer.pad_id, t.micro_batch_size, self.device,
                                                   schedule(step), self.cfg.optimizer.clip_grad, self.dp_group)
            else:
                metrics = supervised_step(self.model, optimizer, seqs, rl.pack_length, self.tokenizer.pad_id,
                                          t.micro_batch_size, self.device, schedule(step),
                                          self.cfg.optimizer.clip_grad, self.dp_group, precision=t.precision)
            if step % self.cfg.logger.log_interval == 0 or step == rl.warmup_steps:
                logger.log(step, metrics, kind="warmup")
        self.backend.suspend()  # the prefix cache holds keys/values of the weights before the warm-up
        self.warmup_done = True

    def evaluate(self) -> dict[str, float]:
        self._sync()
        n, at = self.dp_size * self.pp, self.dp_rank * self.pp + self.pp_rank  # under pp every rank evaluates
        mine = [self.eval_problems[i] for i in range(at, len(self.eval_problems), n)]
        out = self.evaluator.evaluate(self.backend, self.env, self.tokenizer, mine)
        keys = sorted(out)
        sums = all_reduce([out[k] * len(mine) for k in keys], group=self.dp_group if self.pp == 1 else None)
        return {k: v / len(self.eval_problems) for k, v in zip(keys, sums)}

    def grpo_step(self) -> dict[str, float]:
        rl = self.cfg.rl
        local = rl.prompts_per_step // self.dp_size
        first = self.consumed_prompts + self.dp_rank * local
        share = local // self.pp  # under pp each stage's rank generates a share, then they swap rollouts
        mine = first + self.pp_rank * share
        problems = [self.train_problems[(mine + i) % len(self.train_problems)] for i in range(share)]
        t0 = time.perf_counter()
        self._sync()
        rollouts = self.rollouts.generate(self.backend, self.env, self.tokenizer, problems, self.sampling(),
                                          self.cfg.train.seed, self.step, first_group=mine)
        if len(rollouts) != len(problems) * rl.group_size:
            raise RuntimeError(f"the rollout generator returned {len(rollouts)} rollouts for {len(problems)} prompts; "
                               f"it must return rl.group_size={rl.group_size} per prompt, groups consecutive")
        if self.pp > 1:
            from meshtron.rl.pipeline import gather_objects

            rollouts = gather_objects(rollouts, self.pp_group)
        rollout_s = time.perf_counter() - t0
        rewards = assign_advantages(rollouts, rl.group_size, rl.scale_advantages_by_std, rl.reward_clip)
        self.backend.suspend()  # frees the KV cache; the old weights' keys/values must not be reused
        t1 = time.perf_counter()
        args = (self.train_model, self.optimizer, rl, self.cfg.optimizer.clip_grad, self.tokenizer.pad_id,
                self.cfg.train.micro_batch_size, self.device)
        if self.pipeline is not None:
            from meshtron.rl.pipeline import PipelineGRPOUpdate

            update = PipelineGRPOUpdate(self.pipeline, self.ref_parts, *args, group=self.dp_group)
        else:
            update = GRPOUpdate(*args, self.ref_model, self.dp_group)
        update.precision = self.cfg.train.precision   # training forwards; rollouts run on the fp32 weights
        mini_batches = split_mini_batches(rollouts, rl.updates_per_step, self.cfg.train.seed, self.step,
                                          self.consumed_prompts, rl.prompts_per_step, rl.group_size)

        def next_lr() -> float:
            self.optimizer_steps += 1
            return self.schedule(self.optimizer_steps)

        metrics = update.run(mini_batches, next_lr)
        train_s = time.perf_counter() - t1
        self.consumed_prompts += rl.prompts_per_step
        self.step += 1
        return {**self._reward_metrics(rewards, rollouts), **metrics, "rollout_s": rollout_s, "train_s": train_s,
                "generation_share": rollout_s / (rollout_s + train_s)}

    def _reward_metrics(self, rewards: torch.Tensor, rollouts) -> dict[str, float]:
        g = self.cfg.rl.group_size
        success = [sum(r.reward >= 1.0 for r in rollouts[i:i + g]) for i in range(0, len(rollouts), g)]
        k = min(self.cfg.rl.eval_k, g)
        n, s, s2, zero_var, p1, pk, length = all_reduce(group=self.dp_group, values=[
            float(len(rewards)), float(rewards.sum()), float((rewards ** 2).sum()),
            zero_variance_fraction(rewards, g) * len(success), sum(pass_at_k(g, c, 1) for c in success),
            sum(pass_at_k(g, c, k) for c in success), float(sum(len(r.completion_ids) for r in rollouts))])
        groups = n / g
        mean = s / n
        return {"reward_mean": mean, "reward_std": max(s2 / n - mean * mean, 0.0) ** 0.5,
                "zero_variance_groups": zero_var / groups, "pass@1": p1 / groups, f"pass@{k}": pk / groups,
                "completion_tokens_mean": length / n, "rollout_tokens": length}

    # ---- checkpoints ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "optimizer_steps": self.optimizer_steps, "consumed_prompts": self.consumed_prompts,
                "warmup_done": self.warmup_done, "rng": rng_state(), "schedule": self.schedule.state_dict(),
                "ref_model": None if self.ref_model is None else self._ref_state()}

    def _ref_state(self) -> dict[str, torch.Tensor]:
        """The reference weights whole (tensor-parallel shards gathered, pipeline stages collected:
        every rank loads its own part)."""
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.ref_model.state_dict().items()}
        if self.pp > 1:
            parts: list[Optional[dict]] = [None] * self.pp
            dist.all_gather_object(parts, state, group=self.pp_group)
            state = {k: v for part in parts for k, v in part.items()}
        return state

    def save(self) -> None:
        self.checkpoints.save(self.step, self.train_model, self.optimizer, self.state(),
                              yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False))

    def load(self, path: str | Path) -> None:
        state = load_checkpoint(path, self.train_model, self.optimizer)
        if state.get("model_only"):
            return
        with trainer_state_errors(path):  # a hand-edited trainer_state.json is one line, not a traceback
            self.step, self.optimizer_steps = int(state["step"]), int(state["optimizer_steps"])
            self.consumed_prompts, self.warmup_done = int(state["consumed_prompts"]), bool(state["warmup_done"])
            if state.get("ref_model") is not None:
                self.ref_model = self._frozen_copy()
                with torch.no_grad():
                    for name, target in self.ref_model.state_dict().items():
                        value = state["ref_model"][name].to(self.device)
                        if isinstance(target, DTensor):
                            value = distribute_tensor(value, target.device_mesh, target.placements)
                        target.copy_(value)
            set_rng_state(state["rng"])

    def _frozen_copy(self) -> torch.nn.Module:
        """A frozen copy of the trained weights (under pp: of this rank's stages, kept in ref_parts)."""
        if self.pipeline is not None:
            from meshtron.parallel.parts import ModelParts

            self.ref_parts = [copy.deepcopy(part).eval().requires_grad_(False) for part in self.pipeline.parts]
            return ModelParts(self.ref_parts)
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # ---- the loop ------------------------------------------------------------------------------

    def train(self) -> list[dict[str, Any]]:
        cfg, rl = self.cfg, self.cfg.rl
        if self.rank == 0:
            save_config(cfg, self.run_dir / "config.yaml")
        logger = MetricsLogger(cfg.logger, self.run_dir, cfg.train.train_iters, config_to_dict(cfg),
                               initial_step=self.step, enabled=self.rank == 0)
        started = time.perf_counter()
        try:
            logger.message(f"model: {count_parameters(cfg.model, self.tokenizer.vocab_size) / 1e6:.2f}M parameters, "
                           f"environment {'+'.join(cfg.env.names)}, {self.world_size} process(es), "
                           f"{rl.prompts_per_step} prompts x {rl.group_size} samples per step")
            if not self.warmup_done:
                self.warmup(logger)
            if self.step == 0:
                initial = self.evaluate()
                logger.log(0, initial, kind="eval")
                self._curve_row(0, None, initial)
            if rl.kl_beta > 0 and self.ref_model is None:
                self.ref_model = self._frozen_copy()
            self._loop(logger)
            final = self.evaluate()
            logger.log(self.step, {**final, "wall_s": time.perf_counter() - started}, kind="eval")
            self._curve_row(self.step, None, final)
            if cfg.checkpoint.save_at_end:
                self.save()
            self.checkpoints.wait()
        finally:
            logger.close()
        return self.history

    def _loop(self, logger: MetricsLogger) -> None:
        cfg = self.cfg
        while self.step < cfg.train.train_iters:
            metrics = self.grpo_step()
            self.history.append({"step": self.step, **metrics})
            logger.advance(1)
            evaluation = None
            if cfg.rl.eval_interval and self.step % cfg.rl.eval_interval == 0 and self.step < cfg.train.train_iters:
                evaluation = self.evaluate()
                logger.log(self.step, evaluation, kind="eval")
            if self.step % cfg.logger.log_interval == 0 or self.step == cfg.train.train_iters:
                logger.log(self.step, metrics)
            self._curve_row(self.step, metrics, evaluation)
            if cfg.checkpoint.save_interval and self.step % cfg.checkpoint.save_interval == 0:
                self.save()

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
