"""Pipeline-parallel inference: the engine's forward split into the pipeline stages training uses, one
stage per pp rank, each stage possibly tensor-parallel (a `TPGroup` of its own ranks).

Who does what (pp stages x tp ranks; `PipelineMember` is one rank's share):
- The leader is tp rank 0 of the *last* stage. It runs the whole `LLMEngine`: scheduler, block
  tables, sampling (the logits are made there, so the sampled tokens are already beside the
  scheduler), HTTP when serving. Before each forward it broadcasts the step's `ScheduledChunk`s (token
  ids, positions, block tables, Mamba state slots) to every rank of the pipeline over a gloo message
  group, as tensor-parallel serving does (`tp_serving.Leader` / `follow`).
- Every rank builds the step's batch from those chunks for its own stage. The first stage embeds the
  tokens; every other stage receives its input hidden states from the stage before it (tp rank i
  from tp rank i of the previous stage: hidden states are replicated over tp) and sends its output
  to the next, on the pp group of the mesh (point-to-point, tensors on the mesh's device, every
  send matched by one receive in the same order; the group's timeout bounds a wait on a dead
  neighbour). The last stage's head makes the logits.
- KV blocks: the block tables are the scheduler's (one `KVCacheManager` on the leader, every stage
  gets the same tables), but each stage's `PagedKVCache` holds tensors only for the attention layers
  it runs, so a stage's KV memory is the single-process figure times its share of the attention
  layers (divided by tp). Mamba layers keep their per-request states in the stage that runs them.
  `kv_cache_memory_mb` is a per-rank budget: the blocks are as many as the stage with the most KV
  bytes per token fits in it (the stages agree on the count with one all-reduce).

Steps in flight (the asynchronous scheme): the leader keeps up to pp scheduled steps in the pipeline
at once (`PipelineEngine.depth`). Each `step()` schedules a new step from the requests that are not
in flight and announces it, so stage 0 starts on it at once, then runs its own (last) stage of the
oldest step, samples it and hands its tokens to the scheduler. In a steady state stage s works on
the step announced pp - 1 - s steps ago: no stage waits for another, unlike one step at a time
(each stage busy 1 / pp of the time). The price: a request is in at most one step at a time (its
next token is the next step's input), so with fewer running requests than steps in flight some
stages idle; requests in flight are not scheduled, not preempted, and count against max_num_seqs.
Followers receive the announcements on a thread of their own, so the leader's announcement of a
new step never waits for a follower's forward of an older one. `engine.pp_micro_batches` (default
1) further cuts each step into consecutive runs of requests that follow each other through the
stages (GPipe style within the step). Limits: no CUDA graphs, no speculative decoding, and the CUDA
start-up profile that sizes the cache from free memory needs the whole model, so
`kv_cache_memory_mb` (or `num_blocks`) must be given with a CUDA device.

    torchrun --nproc-per-node 4 -m meshtron serve --checkpoint DIR --pp 2 --tp 2
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import deque
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.inference.config import EngineConfig
from meshtron.inference.engine import LLMEngine
from meshtron.inference.mamba_state import StateSlotPool
from meshtron.inference.outputs import RequestOutput
from meshtron.inference.paged_context import PagedBatch, build_paged_batch
from meshtron.inference.runner import ModelRunner, choose_layout, kv_bytes_per_token
from meshtron.inference.sampler import sample_rows
from meshtron.inference.scheduler import SampledToken, ScheduledChunk, SchedulerOutput
from meshtron.inference.tp_serving import TPGroup
from meshtron.inference.varlen_context import build_varlen_batch
from meshtron.parallel.pipeline_stages import PipelineStageModule, split_layers

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

log = logging.getLogger("meshtron.engine")


def stage_ranges(num_sublayers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None) -> list[range]:
    """The sublayers of each of `pp` stages: training's split (`split_layers`, with its first/last
    overrides) when the pattern divides evenly or overrides are given; else the first
    `num_sublayers % pp` stages get one sublayer more."""
    if first is not None or last is not None or num_sublayers % pp == 0:
        return split_layers(num_sublayers, pp, first, last)
    if num_sublayers < pp:
        raise ConfigError(f"--pp: {pp} stages need at least {pp} sublayers; the model has {num_sublayers}; lower --pp")
    base, extra = divmod(num_sublayers, pp)
    bounds = [sum(base + (1 if i < extra else 0) for i in range(s)) for s in range(pp + 1)]
    return [range(bounds[s], bounds[s + 1]) for s in range(pp)]


class InferenceStage(nn.Module):
    """One pipeline stage (`PipelineStageModule`, the training split) as the engine's model:
    forward(x, ctx) with x the step's tokens on the first stage, else the previous stage's hidden
    states (rows, q, hidden); returns hidden states, or logits on the last stage. `layers` are the
    stage's sublayers (their mixers keep their global layer ids, which key the KV and state caches);
    `cfg` and `vocab_size` are the whole model's."""

    def __init__(self, part: PipelineStageModule):
        super().__init__()
        self.part = part
        self.cfg, self.vocab_size = part.cfg, part.vocab_size
        self.layers = nn.ModuleList(part.layers.values())
        self.is_first, self.is_last = part.is_first, part.is_last
        self.hidden_size = part.cfg.hidden_size

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        p = self.part
        if p.is_first:
            h = p.embedding(x)
            if p.position_embedding is not None:
                h = h + p.position_embedding(ctx.positions)
        else:
            h = x
        if p.rotary is not None:
            ctx.rope = p.rotary(ctx.positions)
        if p.is_first:
            h = p.embedding_dropout(h)
        for layer in self.layers:
            h = layer(h, ctx)
        if p.is_last:
            return p.head(p.final_norm(h))  # TP replaces `head` on the part (vocab-parallel tied head)
        return h


def build_stage(model: nn.Module, ranges: list[range], stage: int) -> InferenceStage:
    """Stage `stage` of `model` (a GPTModel; its other layers are dropped with it)."""
    part = PipelineStageModule(model, ranges[stage], stage == 0, stage == len(ranges) - 1)
    return InferenceStage(part)


def empty_stage(model_cfg, vocab_size: int, ranges: list[range], stage: int, device: torch.device) -> InferenceStage:
    """Stage `stage` of a GPTModel of `model_cfg`, with uninitialised parameters on `device`, built without
    the whole model ever existing (it is built on the meta device): a stage to copy weights into (RL
    rollouts under pipeline parallelism copy the trainer's stage)."""
    from meshtron.models import GPTModel
    from meshtron.nn.rope_scaling import build_rotary

    with torch.device("meta"):
        model = GPTModel(model_cfg, vocab_size)
    part = PipelineStageModule(model, ranges[stage], stage == 0, stage == len(ranges) - 1)
    part.to_empty(device=device)
    if part.rotary is not None:  # its one buffer is not a parameter: computed again, not copied
        part.rotary = build_rotary(model_cfg).to(device)
    return InferenceStage(part)


@dataclasses.dataclass
class StageLink:
    """Point-to-point links of one stage to its neighbours on `group` (this rank's pp group, whose rank
    i runs stage i)."""

    group: Any
    stage: int
    num_stages: int
    device: torch.device

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def send(self, hidden: torch.Tensor):
        return dist.isend(hidden.contiguous(), group=self.group, group_dst=self.stage + 1)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, group=self.group, group_src=self.stage - 1)
        return out


def split_micro_batches(chunks: list[ScheduledChunk], count: int) -> list[list[ScheduledChunk]]:
    """`chunks` cut into at most `count` runs of consecutive chunks with about equal token counts."""
    count = max(1, min(count, len(chunks)))
    sizes = [len(c.token_ids) for c in chunks]
    total, groups, current, done = sum(sizes), [], [], 0
    for i, (c, n) in enumerate(zip(chunks, sizes)):
        current.append(c)
        done += n
        left_chunks, left_groups = len(chunks) - i - 1, count - len(groups) - 1
        if left_groups > 0 and (done * count >= total * (len(groups) + 1) or left_chunks == left_groups):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


class PipelineRunner(ModelRunner):
    """`ModelRunner` of one stage: builds each micro-batch's batch from the broadcast chunks, receives
    its input from the previous stage, runs the stage, sends the output on. On the last stage the
    micro-batches' logits are joined in chunk order, so sampling and prompt scoring are the
    single-process runner's."""

    def __init__(self, stage: InferenceStage, cfg: EngineConfig, device: torch.device, link: StageLink,
                 micro_batches: int):
        super().__init__(stage, cfg, device)
        self.link, self.micro_batches = link, micro_batches
        self.dtype = next(stage.parameters()).dtype

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """`ModelRunner.execute`, less the rows of requests removed while their step was in flight."""
        if out.is_empty:
            return {}
        logits, req_ids = self._forward(out.chunks)
        keep = [i for i, r in enumerate(req_ids) if r in self.params]
        if len(keep) < len(req_ids):
            logits, req_ids = logits[keep], [req_ids[i] for i in keep]
        if not req_ids:
            return {}
        return sample_rows(logits, [self.params[r] for r in req_ids], [self.generators[r] for r in req_ids], req_ids,
                           [self.requests[r] for r in req_ids])

    def forward_only(self, chunks: list[ScheduledChunk]) -> None:
        if chunks:
            self._eager_forward(chunks)

    def _build(self, chunks: list[ScheduledChunk]) -> PagedBatch:
        if self.cfg.layout == "varlen":
            self.num_forwards["varlen"] += 1
            return build_varlen_batch(chunks, self.cache, self.states, self.decode_attention)
        if self.cfg.layout == "auto":
            layout, segment_len = choose_layout(chunks, self.cost_weights)
        else:
            layout, segment_len = ("packed", None) if self.cfg.layout == "packed" else ("rows", None)
        self.num_forwards[layout] += 1
        return build_paged_batch(chunks, self.cache, layout, segment_len)

    def _eager_forward(self, chunks: list[ScheduledChunk]):
        link, pending, outputs, batches = self.link, [], [], []
        for group in split_micro_batches(chunks, self.micro_batches):
            batch = self._build(group)
            x = batch.tokens if link.is_first else link.recv((*batch.tokens.shape, self.model.hidden_size), self.dtype)
            h = self.model(x, batch.ctx)
            if link.is_last:
                outputs.append(h.reshape(-1, h.shape[-1]))
                batches.append(batch)
            else:
                pending.append(link.send(h))
        for work in pending:  # the sends complete once the next stage has received them
            work.wait()
        if not link.is_last:
            return None, [], None
        return torch.cat(outputs), *_join(batches)


def _join(batches: list[PagedBatch]) -> tuple[list[str], PagedBatch]:
    """The micro-batches' batches as one over their concatenated logits (sample and token indices shifted)."""
    if len(batches) == 1:
        return batches[0].sample_req_ids, batches[0]
    sample_index, req_ids, token_index, at = [], [], [], 0
    for b in batches:
        sample_index.append(b.sample_index + at)
        req_ids += b.sample_req_ids
        token_index += [index + at for index in b.token_index]
        at += b.tokens.numel()
    joined = PagedBatch(tokens=torch.empty(0), ctx=None, sample_index=torch.cat(sample_index),
                        sample_req_ids=req_ids, token_index=token_index)
    return req_ids, joined


def has_recurrent_state(stage: InferenceStage) -> bool:
    """Whether the whole model (any stage) has Mamba layers."""
    return "M" in stage.cfg.pattern


def resolve_pipeline_config(stage: InferenceStage, cfg: EngineConfig, device: torch.device, group) -> EngineConfig:
    """`cfg` resolved for the whole pipeline (every rank of `group` calls this): the rules of a model
    with Mamba layers if any stage has one, and one block count for all stages: the one the stage
    with the most KV bytes per token (this rank's tp share) fits in the per-rank budget."""
    cfg.validate()
    if cfg.cuda_graphs:
        raise ConfigError("engine.cuda_graphs: not supported with pipeline-parallel serving (--pp > 1); turn it off")
    if getattr(cfg, "speculative_method", "none") != "none":
        raise ConfigError("engine.speculative_method: speculative decoding is not supported with pipeline-parallel "
                          "serving (--pp > 1); set it to none")
    if device.type == "cuda" and cfg.num_blocks is None and cfg.kv_cache_memory_mb is None:
        raise ConfigError("engine.kv_cache_memory_mb: null sizes the cache by profiling the whole model, which a "
                          "pipeline stage does not hold; give kv_cache_memory_mb (per rank) or num_blocks with --pp > 1")
    mine = torch.tensor([kv_bytes_per_token(stage)], dtype=torch.int64, device=_group_device(group))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return cfg.resolve(stage.cfg.max_position_embeddings, int(mine.item()), recurrent_state=has_recurrent_state(stage))


def _group_device(group) -> torch.device:
    from meshtron.parallel.distributed import group_device

    return group_device(group)


class PipelineEngine(LLMEngine):
    """The leader's `LLMEngine` (tp rank 0 of the last stage): its own stage, the whole pipeline's
    scheduler (state slots when any stage has Mamba layers) and a `PipelineRunner`. `config` must
    come from `resolve_pipeline_config`.

    Up to `depth` (default pp) steps are in flight: `step()` schedules a step from the running and
    waiting requests that are not in flight, announces it (the first stage starts on it at once), and
    when `depth` steps are out, runs the last stage of the oldest one, samples it and applies its
    tokens. The stages thus work on different steps at once (stage 0 on the newest, the last stage
    on the oldest); a request is in at most one step at a time, since its next token is the next
    step's input. Requests in flight are neither scheduled nor preempted, and count against
    max_num_seqs. `depth = 1` gives the synchronous engine (one step through every stage at a time)."""

    def __init__(self, stage: InferenceStage, tokenizer, config: EngineConfig, link: StageLink, *,
                 model_name: str = "meshtron"):
        self._hook = None
        super().__init__(stage, tokenizer, config, model_name=model_name)
        if has_recurrent_state(stage) and self.scheduler.state_slots is None:
            self.scheduler.state_slots = StateSlotPool(self.config.max_num_seqs)
        self.runner = PipelineRunner(stage, self.config, self.device, link, micro_batches_of(self.config, link))
        self.depth = link.num_stages
        self._in_flight: deque[SchedulerOutput] = deque()
        self._flying: set[str] = set()
        self.max_in_flight = 0  # the most steps that were in flight at once (tests, stats)

    # the step hook: a "release" or "stop" waits for the steps in flight first (the stages must
    # finish them: a stage's send waits for the next stage's receive)
    @property
    def step_hook(self):
        return None if self._hook is None else self._announce

    @step_hook.setter
    def step_hook(self, hook) -> None:
        self._hook = hook

    def _announce(self, kind: str, payload: Any = None) -> None:
        if kind in ("release", "stop"):
            self._drain()
        self._hook(kind, payload)

    def _drain(self) -> list[RequestOutput]:
        outputs = []
        while self._in_flight:
            outputs += self._finish_oldest()
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's step over the requests not in flight (they are hidden from it meanwhile)."""
        s = self.scheduler
        if not self._flying:
            return s.schedule()
        before, cfg = list(s.running), s.cfg
        s.running = [r for r in before if r.req_id not in self._flying]
        s.cfg = dataclasses.replace(cfg, max_num_seqs=max(0, cfg.max_num_seqs - len(self._flying)))
        try:
            return s.schedule()
        finally:
            after, s.cfg = s.running, cfg
            kept, old = {id(r) for r in after}, {id(r) for r in before}
            s.running = ([r for r in before if r.req_id in self._flying or id(r) in kept]
                         + [r for r in after if id(r) not in old])

    def step(self) -> list[RequestOutput]:
        with self._lock:
            self._drain_inbox()
            if self._suspended is not None:
                return []
            sched = self._schedule()
            if not sched.is_empty:
                self.num_steps += 1
                if self._hook is not None:
                    self._hook("step", sched.chunks)
                self._in_flight.append(sched)
                self._flying.update(c.req_id for c in sched.chunks)
                self.max_in_flight = max(self.max_in_flight, len(self._in_flight))
            if not self._in_flight or (not sched.is_empty and len(self._in_flight) < self.depth):
                return []
            return self._finish_oldest()

    def _finish_oldest(self) -> list[RequestOutput]:
        sched = self._in_flight.popleft()
        self._flying.difference_update(c.req_id for c in sched.chunks)
        live = self.scheduler.requests  # a request aborted while in flight is gone from it
        try:
            sampled = self.runner.execute(sched)
        except Exception as e:  # fail this step's requests, keep serving the others
            return self._emit([self._fail(c.req_id, f"the forward failed: {type(e).__name__}: {e}")
                               for c in sched.chunks if c.req_id in live])
        for req_id, scored in self.runner.prompt_log_probs.items():
            if req_id in live:
                live[req_id].prompt_log_probs.extend(scored)
        failed = [self._fail(req_id, token.error) for req_id, token in sampled.items() if token.error and req_id in live]
        changed = self.scheduler.update_from_output(sched, sampled)
        return self._emit(failed + self._outputs(changed))

    def suspend(self) -> None:
        with self._lock:
            self._emit(self._drain())
        super().suspend()

    def stats(self) -> dict:
        return {**super().stats(), "steps_in_flight": len(self._in_flight), "max_steps_in_flight": self.max_in_flight}


def micro_batches_of(cfg: EngineConfig, link: StageLink) -> int:
    return cfg.pp_micro_batches or 1


@dataclasses.dataclass
class PipelineMember:
    """One rank's share of a pipeline-parallel engine: its stage's runner, and on the leader the engine.
    `messages`: the `TPGroup` over every rank of the pipeline, led by the leader, that carries the
    step messages (`tp_serving.Leader` on the leader's engine; `follow()` elsewhere)."""

    runner: ModelRunner
    messages: TPGroup
    link: StageLink
    engine: Optional[LLMEngine] = None

    @property
    def is_leader(self) -> bool:
        return self.engine is not None

    def follow(self) -> None:
        """Run the leader's forwards until it stops (every rank but the leader). A thread receives the
        leader's messages into a queue, so that the leader's announcement of a new step never waits
        for this rank's forward of an older one (the leader announces the newest step, then runs its
        own stage of the oldest, in which the last stage's tensor-parallel ranks take part)."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()

        def receive() -> None:
            while True:
                try:
                    kind, payload = self.messages.broadcast()
                except Exception as e:  # the leader is gone (the group's timeout): say so in the main thread
                    inbox.put(("error", e))
                    return
                inbox.put((kind, payload))
                if kind == "stop":
                    return

        threading.Thread(target=receive, name="meshtron-pp-messages", daemon=True).start()
        while True:
            kind, payload = inbox.get()
            if kind == "step":
                self.runner.forward_only(payload)
            elif kind == "release":
                self.runner.release()
            elif kind == "stop":
                return
            elif kind == "error":
                raise payload
            # "ping": the leader is alive and idle


def pipeline_messages(pp_group, tp_group, timeout_s: float) -> TPGroup:
    """A gloo group over the ranks of this rank's pipeline (its pp x tp ranks), led by tp rank 0 of the
    last stage. Every rank of the world calls it (each pipeline of the world gets its own group)."""
    pp_ranks = dist.get_process_group_ranks(pp_group)
    tp_ranks = dist.get_process_group_ranks(tp_group) if tp_group is not None else [dist.get_rank()]
    # this pipeline's ranks, ordered (stage, tp rank): gather each stage's tp ranks over the pp group
    stages: list[Any] = [None] * len(pp_ranks)
    dist.all_gather_object(stages, tp_ranks, group=pp_group)
    mine = [r for stage in stages for r in stage]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    groups = sorted({tuple(g) for g in everyone}, key=lambda g: g[0])
    ordered = [list(g) for g in groups]
    group, _ = dist.new_subgroups_by_enumeration(ordered, timeout=timedelta(seconds=timeout_s), backend="gloo")
    leader = mine.index(stages[-1][0])
    return TPGroup(group, leader)


def build_pipeline_member(model: nn.Module, tokenizer, config: EngineConfig, *, pp_group, tp_mesh=None,
                          ranges: Optional[list[range]] = None, timeout_s: float = 600.0,
                          model_name: str = "meshtron", load=None, dtype: Optional[torch.dtype] = None
                          ) -> PipelineMember:
    """This rank's share of the pipeline engine for `model` (a GPTModel built alike on every rank; only
    this rank's stage is kept). `pp_group`: this rank's pp group (rank i runs stage i); `tp_mesh`: its
    stage's tensor-parallel mesh (None: no TP); `ranges`: each stage's sublayers (default
    `stage_ranges`); `load(part)`: loads the weights into the stage module after TP sharding (a
    checkpoint); `dtype`: the served dtype, cast to after loading. A collective over the world."""
    pp, stage_id = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    ranges = ranges or stage_ranges(len(model.cfg.pattern), pp)
    stage = build_stage(model, ranges, stage_id)
    if tp_mesh is not None:
        from meshtron.parallel.tensor_parallel import apply_tp

        apply_tp(stage.part, tp_mesh, sequence_parallel=False, loss_parallel=False)
    if load is not None:
        load(stage.part)
    if dtype is not None:
        stage.to(dtype)
    return member_for_stage(stage, tokenizer, config, pp_group=pp_group,
                            tp_group=tp_mesh.get_group() if tp_mesh is not None else None, timeout_s=timeout_s,
                            model_name=model_name)


def member_for_stage(stage: InferenceStage, tokenizer, config: EngineConfig, *, pp_group, tp_group=None,
                     timeout_s: float = 600.0, model_name: str = "meshtron") -> PipelineMember:
    """This rank's share of the pipeline engine around its `stage` (already sharded and loaded): stage i
    of rank i of `pp_group`, tensor-parallel over `tp_group` (None: no TP). A collective over the world."""
    stage.eval()
    device = next(stage.parameters()).device
    link = StageLink(pp_group, dist.get_rank(pp_group), dist.get_world_size(pp_group), device)
    messages = pipeline_messages(pp_group, tp_group, timeout_s)
    resolved = resolve_pipeline_config(stage, config, device, messages.group)
    if messages.is_leader:
        engine = PipelineEngine(stage, tokenizer, resolved, link, model_name=model_name)
        return PipelineMember(engine.runner, messages, link, engine)
    runner = PipelineRunner(stage, resolved, device, link, micro_batches_of(resolved, link))
    return PipelineMember(runner, messages, link)


def load_pipeline_member(checkpoint: str, config: EngineConfig, *, pp_group, tp_mesh=None, timeout_s: float = 600.0,
                         model_name: Optional[str] = None) -> PipelineMember:
    """`build_pipeline_member` for a checkpoint: the model and tokenizer it was trained with, this rank's
    stage built alone (on the meta device first, so the whole model never exists in this process),
    sharded over `tp_mesh`, loaded from the checkpoint (the stage's parameters only), in `config.dtype`."""
    from meshtron.checkpoint import checkpoint_run_config, load_checkpoint
    from meshtron.data.tokenizer import build_tokenizer
    from meshtron.inference.loading import model_name_for, read_chat_template
    from meshtron.training.precision import resolve_engine_dtype
    from meshtron.training.trainer import resolve_device

    config.validate()
    cfg = checkpoint_run_config(checkpoint, config.tokenizer)  # the carried tokenizer, from any directory
    tokenizer = build_tokenizer(cfg.tokenizer)
    tokenizer.chat_template = read_chat_template(cfg.tokenizer.path if cfg.tokenizer.type == "hf" else None)
    device = resolve_device(config.device)
    pp = dist.get_world_size(pp_group)
    p = cfg.parallel  # the training split when the checkpoint was trained with as many stages, without virtual ones
    same_split = p.pp == pp and p.pp_virtual_stages == 1
    ranges = stage_ranges(len(cfg.model.pattern), pp, p.pp_first_stage_sublayers if same_split else None,
                          p.pp_last_stage_sublayers if same_split else None)
    stage = empty_stage(cfg.model, tokenizer.vocab_size, ranges, dist.get_rank(pp_group), device)
    if tp_mesh is not None:
        from meshtron.parallel.tensor_parallel import apply_tp

        apply_tp(stage.part, tp_mesh, sequence_parallel=False, loss_parallel=False)
    load_checkpoint(checkpoint, stage.part)  # every parameter and persistent buffer of the stage
    stage.to(resolve_engine_dtype(config.dtype, device))
    return member_for_stage(stage, tokenizer, config, pp_group=pp_group,
                            tp_group=tp_mesh.get_group() if tp_mesh is not None else None, timeout_s=timeout_s,
                            model_name=model_name or model_name_for(checkpoint))


def serve_pipeline_parallel(checkpoint: str, engine_cfg: EngineConfig, *, pp: int, tp: Optional[int], model_name, host: str,
                            port: int, drain_timeout_s: float, log_level: str, timeout_s: float = 600.0,
                            **server_options) -> int:
    """Under torchrun: pp stages of tp ranks each (pp x tp = the number of processes; tp None: the rest),
    served from the pipeline's leader (tp rank 0 of the last stage: global rank (pp - 1) x tp)."""
    from meshtron.inference.server import serve

    def run(factory) -> int:
        return serve(factory, host, port, drain_timeout_s=drain_timeout_s, log_level=log_level, **server_options)

    return run_pipeline_parallel(checkpoint, engine_cfg, run, pp=pp, tp=tp, model_name=model_name, timeout_s=timeout_s)


def run_pipeline_parallel(checkpoint: str, engine_cfg: EngineConfig, lead_with, *, pp: int, tp: Optional[int],
                          model_name=None, timeout_s: float = 600.0) -> int:
    """Under torchrun: the pipeline of `serve_pipeline_parallel`; its leader calls `lead_with(factory)`
    (factory: the leading engine; an HTTP server, or a data-parallel replica's worker) and returns what
    it returns, the other processes follow until it stops."""
    from meshtron.inference.pipeline_args import parallel_degrees
    from meshtron.inference.tp_serving import Leader, lead
    from meshtron.parallel.dims import ParallelDims
    from meshtron.parallel.distributed import init_distributed, world_from_env
    from meshtron.training.trainer import resolve_device

    world_size = world_from_env()[2]
    pp, tp = parallel_degrees(pp, tp, world_size)
    device = resolve_device(engine_cfg.device)
    init_distributed(device, timeout_s)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=pp, ep=1, world_size=world_size)
        mesh = dims.build_mesh(device.type, timeout_s)
        member = load_pipeline_member(checkpoint, engine_cfg, pp_group=mesh["pp"].get_group(),
                                      tp_mesh=mesh["tp"] if tp > 1 else None, timeout_s=timeout_s,
                                      model_name=model_name)
        if not member.is_leader:
            member.follow()
            return 0
        leader = Leader(member.messages, ping_s=timeout_s / 4)
        engine = lead(member.engine, leader)
        log.info("pipeline-parallel serving: %d stages x %d tensor-parallel ranks; this rank (%d) leads",
                 pp, tp, dist.get_rank())
        try:
            return lead_with(lambda: engine)
        finally:
            leader("stop")  # release the followers even if the server never came up
    finally:
        dist.destroy_process_group()
