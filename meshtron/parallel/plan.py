"""Memory plan of a parallel layout from the config alone: parameter, gradient, optimizer-state and
activation bytes per pipeline rank, computed on the meta device and fake tensors (no allocation).

Parameters come from a meta-device model, the placements of the ParallelStyle objects `apply_tp`
applies (`tp_placements`) and the sharding rules of `apply_fsdp`;
activations from tracing the tensors autograd saves for backward during one fake forward of the
rank's sublayers, then scaling them by the layout and the pipeline schedule (see `estimate_memory`).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from meshtron.api import internal_api
from meshtron.compat import fake_tensor_mode, storage_key
from meshtron.config.fields import ConfigError
from meshtron.config.schema import ModelConfig, RunConfig
from meshtron.models.gpt import GPTModel
from meshtron.models.mtp import combine_losses, forward_for_loss
from meshtron.nn.context import PackedContext
from meshtron.nn.moe.experts import GroupedExperts
from meshtron.parallel.activation_checkpoint import SELECTIVE
from meshtron.parallel.dims import ParallelDims
from meshtron.parallel.tensor_parallel import ShardParameters, SumGradOfLastFeatures, check_tp_divisibility, tp_plan

FP32_BYTES = 4  # parameters, gradients and optimizer states are fp32 in every precision (bf16 only casts compute)

# ---- counting saved tensors ---------------------------------------------------------------------

def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's memory (a DTensor's local shard)."""
    if isinstance(t, DTensor):
        with torch.no_grad():  # to_local without grad returns the local tensor itself, no graph node
            return t.to_local()
    return t


def _storage_key(t: torch.Tensor) -> int:
    # The StorageImpl address: several saved views of one tensor (and one tensor saved by several
    # ops) hold a single allocation. Meta and fake tensors have no data pointer, but do have this.
    return storage_key(local_tensor(t))


class SavedTensorCounter:
    """While active, records the bytes of every distinct storage autograd saves for backward,
    excluding parameters (counted as parameters; FSDP's gathered ones are freed after forward).

    `region()` names where the forward is when a tensor is saved; `by_region` sums bytes by it.
    Saved tensors are kept referenced until `close()`, so that a freed storage's address is never
    reused by a later one within the measurement.
    """

    def __init__(self, model: nn.Module, region: Callable[[], Hashable] = lambda: None):
        self.model, self.region = model, region
        self.by_region: dict[Hashable, int] = {}
        self._seen: set[int] = set()
        self._kept: list[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.by_region.values())

    def _parameter_keys(self) -> set[int]:
        # FSDP swaps gathered parameters in for the forward: ask the model at each save
        return {_storage_key(p) for p in self.model.parameters()}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self._seen:
            if key not in self._parameter_keys():
                nbytes = local_tensor(t).untyped_storage().nbytes()
                where = self.region()
                self.by_region[where] = self.by_region.get(where, 0) + nbytes
                self._kept.append(t)
            self._seen.add(key)
        return t

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self.close()

    def close(self) -> None:
        self._kept.clear()


class _FixedParametersCounter(SavedTensorCounter):
    """A SavedTensorCounter for a model whose parameters stay the same objects during the forward (the
    plan's fake model: no FSDP), which reads their storages once instead of at every save."""

    def __init__(self, model: nn.Module, region: Callable[[], Hashable] = lambda: None):
        super().__init__(model, region)
        self._keys = super()._parameter_keys()

    def _parameter_keys(self) -> set[int]:
        return self._keys


# ---- the layout -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chunk:
    """One pipeline stage (model chunk): its sublayers and whether it embeds / runs the head."""
    stage: int
    layer_ids: range
    is_first: bool
    is_last: bool


def rank_chunks(cfg: RunConfig, dims: ParallelDims) -> list[list[Chunk]]:
    """The chunks each pipeline rank runs, by pipeline rank (one chunk of everything without pp)."""
    n = len(cfg.model.pattern)
    if dims.pp == 1:
        return [[Chunk(0, range(n), True, True)]]
    from meshtron.parallel.pipeline_stages import split_layers, stages_of_rank

    p = cfg.parallel
    num_stages = dims.pp * p.pp_virtual_stages
    ranges = split_layers(n, num_stages, p.pp_first_stage_sublayers, p.pp_last_stage_sublayers)
    # the placement pipeline.schedule_class picks: ZB-V runs two chunks per rank in a V (rank r holds
    # stages r and 2pp-1-r); every other schedule loops (stage s on rank s mod pp)
    style = "v" if p.pp_schedule == "zero_bubble" and p.pp_virtual_stages == 2 else "loop"
    return [[Chunk(s, ranges[s], s == 0, s == num_stages - 1) for s in stages_of_rank(r, dims.pp, num_stages, style)]
            for r in range(dims.pp)]


def microbatches_in_flight(cfg: RunConfig, dims: ParallelDims, pp_rank: int, num_microbatches: int) -> float:
    """How many micro-batches' worth of this rank's activations the schedule holds at its peak."""
    m, p, v = num_microbatches, dims.pp, cfg.parallel.pp_virtual_stages
    if p == 1:
        return 1.0  # accumulation frees a micro-batch's activations in its backward, before the next forward
    schedule = cfg.parallel.pp_schedule
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - pp_rank))
    if schedule == "interleaved_1f1b":
        # warm-up forwards (chunk-micro-batches) plus the one in the steady state; a chunk is 1/v of the rank
        return min(m * v, (v - 1) * p + 2 * (p - 1 - pp_rank) + 1) / v
    return float(min(m, p))  # zero_bubble


# ---- parameters -----------------------------------------------------------------------------------

@internal_api
def style_placements(style: ParallelStyle, module: nn.Module) -> dict[str, Placement]:
    """The tp placement `style` gives each parameter of `module`, torch's rules: ColwiseParallel splits a
    Linear's output features (weight and bias Shard(0)) and an Embedding's columns (Shard(1));
    RowwiseParallel a Linear's input features (weight Shard(1), bias Replicate) and an Embedding's rows
    (Shard(0)); SequenceParallel replicates every parameter; the Prepare* styles and the gradient hook
    own none."""
    params = dict(module.named_parameters())
    if isinstance(style, ColwiseParallel):
        return {n: Shard(1) if isinstance(module, nn.Embedding) else Shard(0) for n in params}
    if isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Embedding):
            return {n: Shard(0) for n in params}
        return {n: Shard(1) if n == "weight" else Replicate() for n in params}
    if isinstance(style, SequenceParallel):
        return dict.fromkeys(params, Replicate())
    if isinstance(style, ShardParameters):
        return {n: p for n, p in style.placements.items() if n in params}
    if isinstance(style, (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput, SumGradOfLastFeatures)):
        return {}
    raise TypeError(f"no placement rule for {type(style).__name__}; add one to style_placements")


def tp_placements(model: nn.Module, *, sequence_parallel: bool = False,
                  loss_parallel: bool = False) -> dict[str, Placement]:
    """name -> tp placement of every parameter `apply_tp` makes a DTensor, read off the same
    `tp_plan`; parameters not named stay plain, whole tensors."""
    out = {}
    for path, style in tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel):
        for name, placement in style_placements(style, model.get_submodule(path)).items():
            out[f"{path}.{name}"] = placement
    return out


@internal_api
def tp_local_shape(shape: torch.Size, placement: Optional[Placement], tp: int, rank: int) -> tuple[int, ...]:
    """The shape tp rank `rank` holds: DTensor's Shard(d) gives each rank ceil(n / tp) of dim d in order,
    the last ones what is left (possibly nothing)."""
    local = list(shape)
    if isinstance(placement, Shard):
        d = placement.dim % len(local)
        chunk = math.ceil(local[d] / tp)
        local[d] = max(0, min(local[d], (rank + 1) * chunk) - rank * chunk)
    return tuple(local)


def local_numel(shape: torch.Size, tp_dim: Optional[int], tp: int, fsdp: int) -> int:
    """Elements this rank holds: the TP shard, then FSDP's dim-0 chunk. FSDP pads dim 0 to a
    multiple of its degree, so every rank allocates ceil(rows / fsdp) rows (rank 0 holds them all)."""
    dims = list(shape)
    if tp_dim is not None:
        dims[tp_dim] = math.ceil(dims[tp_dim] / tp)  # DTensor gives rank 0 the larger chunk if uneven
    if dims and fsdp > 1:
        dims[0] = math.ceil(dims[0] / fsdp)
    return math.prod(dims)


def expert_local_numel(name: str, shape: torch.Size, dims: ParallelDims, etp: bool) -> int:
    """Elements of a routed-expert parameter (experts, ...), the rules of `apply_ep` and `apply_fsdp`:
    experts / ep of them; with expert tensor parallelism the ffn width / tp; then FSDP: under EP over
    dp_shard_mod_ep along dim 0 when it divides evenly, else along dim 1 (padded, ceil), without EP
    over dp_shard x cp along dim 0 (padded)."""
    from meshtron.parallel.expert_parallel import ETP_DIMS

    local = [shape[0] // dims.ep, *shape[1:]]
    leaf = name.rpartition(".")[2]
    if etp and leaf in ETP_DIMS:
        local[ETP_DIMS[leaf]] = math.ceil(local[ETP_DIMS[leaf]] / dims.tp)
    if dims.ep > 1:
        f = dims.dp_shard_mod_ep
        if local[0] % f == 0:
            local[0] //= f
        else:
            local[1] = math.ceil(local[1] / f)
    else:
        local[0] = math.ceil(local[0] / (dims.dp_shard * dims.cp))
    return math.prod(local)


def rank_parameters(model: nn.Module, chunks: list[Chunk], dims: ParallelDims,
                    etp: bool = False) -> list[tuple[str, int, int]]:
    """(name, local elements, local gradient elements) of every parameter a pipeline rank holds;
    `etp`: expert tensor parallelism (with tp > 1)."""
    owners = dict(model.named_modules())
    placements = tp_placements(model) if dims.tp > 1 else {}
    fsdp = dims.dp_shard * dims.cp  # HSDP replicates over dp_replicate
    out = []
    for name, p in _chunk_parameters(model, chunks):
        owner = owners[name.rpartition(".")[0]]
        if isinstance(owner, GroupedExperts) and (dims.ep > 1 or etp):
            numel = expert_local_numel(name, p.shape, dims, etp)
            out.append((name, numel, numel))
            continue
        placement = placements.get(name)
        dim = placement.dim if isinstance(placement, Shard) else None
        numel = local_numel(p.shape, dim, dims.tp, fsdp)
        # Measured: DTensor's backward of a vocabulary-parallel embedding returns a Replicate
        # gradient of the whole table on every TP rank; only FSDP's reduce-scatter shards it again.
        replicated_grad = dim is not None and isinstance(owner, nn.Embedding) and not dims.fsdp_enabled
        out.append((name, numel, p.numel() if replicated_grad else numel))
    return out


def _chunk_parameters(model: GPTModel, chunks: list[Chunk]) -> Iterator[tuple[str, nn.Parameter]]:
    """Parameters of the rank's chunks: their sublayers, the embedding on the first stage (and, with
    tied embeddings, its copy on the last stage: pipeline_stages.PipelineStageModule.tied_copy), the
    final norm and output head on the last (and MTP depths, which only run without a pipeline)."""
    whole = len(chunks) == 1 and chunks[0].is_first and chunks[0].is_last
    layer_ids = {i for c in chunks for i in c.layer_ids}
    first, last = any(c.is_first for c in chunks), any(c.is_last for c in chunks)
    for name, p in model.named_parameters():
        top = name.split(".")[0]
        if top == "layers":
            keep = int(name.split(".")[1]) in layer_ids
        elif top == "embedding":
            keep = first or (last and model.output is None)
        elif top == "position_embedding":
            keep = first
        elif top in ("final_norm", "output"):
            keep = last
        else:
            keep = whole  # mtp
        if keep:
            yield name, p


def optimizer_bytes(cfg: RunConfig, numels: list[int]) -> int:
    """Adam: exp_avg and exp_avg_sq (2 fp32 per element) and a 4-byte step per tensor;
    SGD with momentum: one momentum buffer; plain SGD: nothing."""
    o = cfg.optimizer
    if o.type == "adam":
        return sum(2 * FP32_BYTES * n + FP32_BYTES for n in numels)
    if o.sgd_momentum > 0:
        return sum(FP32_BYTES * n for n in numels)
    return 0


# ---- activations ----------------------------------------------------------------------------------

def local_model_config(cfg: RunConfig, vocab: int, tp: int, etp: bool = False) -> ModelConfig:
    """The model as one tensor-parallel rank computes it: 1/tp of the heads, MLP width and
    (padded) vocabulary, the full hidden size; the routed experts' width / tp only under expert
    tensor parallelism (`etp`)."""
    m = copy.deepcopy(cfg.model)
    if tp > 1:
        m.kv_channels = m.head_dim
        m.num_query_groups = m.num_kv_heads // tp
        m.num_attention_heads //= tp
        if m.num_moe_experts:
            # routed experts are not split over tp (expert parallelism splits them); shared ones are
            m.moe_ffn_hidden_size = m.moe_ffn_size // tp if etp else m.moe_ffn_size
            if m.moe_shared_expert_intermediate_size:
                m.moe_shared_expert_intermediate_size //= tp
        m.ffn_hidden_size = m.ffn_size // tp
        if "M" in m.pattern:
            m.mamba_num_heads, m.mamba_num_groups = m.mamba_heads // tp, m.mamba_num_groups // tp
        m.vocab_size, m.make_vocab_size_divisible_by = vocab // tp, 1
    return m


class RegionTracker:
    """Names the part of the model running now, through forward hooks: ('seq', i) for sublayer i's
    norm, dropout and residual (split along the sequence under SP), ('mixer', i) for its attention
    or MLP, 'embed', 'head_seq' (final norm), 'head' (output layer), 'mtp', and 'loss'."""

    def __init__(self, model: nn.Module):
        self.stack: list[Hashable] = ["other"]
        self.handles = []
        for name, module in model.named_modules():
            tag = self._tag(name)
            if tag is not None:
                self.handles.append(module.register_forward_pre_hook(lambda *_, t=tag: self._push(t)))
                self.handles.append(module.register_forward_hook(lambda *_: self._pop()))

    @staticmethod
    def _tag(name: str) -> Optional[Hashable]:
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) == 2:
            return ("seq", int(parts[1]))
        if parts[0] == "layers" and len(parts) == 3 and parts[2] == "mixer":
            return ("mixer", int(parts[1]))
        named = {"embedding": "embed", "position_embedding": "embed", "final_norm": "head_seq", "output": "head"}
        if len(parts) == 1 and parts[0] in named:
            return named[parts[0]]
        if parts[0] == "mtp" and len(parts) == 2:
            return "mtp"
        return None

    # hooks must return None: a returned value would replace the module's input or output
    def _push(self, tag: Hashable) -> None:
        self.stack.append(tag)

    def _pop(self) -> None:
        self.stack.pop()

    def current(self) -> Hashable:
        return self.stack[-1]

    @contextmanager
    def at(self, tag: Hashable) -> Iterator[None]:
        self.stack.append(tag)
        try:
            yield
        finally:
            self.stack.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _module_fingerprint(layer: nn.Module) -> Hashable:
    """What decides the tensors a sublayer saves: its modules' types, parameter shapes and dtypes and
    plain attributes (the window, the activation, ...), not `layer_id` (which only keys inference caches)."""
    simple = (int, float, str, bool, type(None), torch.dtype)

    def plain(v: Any) -> Any:
        if isinstance(v, simple) or (isinstance(v, tuple) and all(isinstance(x, simple) for x in v)):
            return v
        if callable(v) and not isinstance(v, nn.Module):  # an activation function
            return getattr(v, "__qualname__", type(v).__qualname__)
        return type(v).__qualname__

    out = []
    for name, m in layer.named_modules():
        attrs = tuple(sorted((k, plain(v)) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in ("layer_id", "training")))
        params = tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False))
        out.append((name, type(m).__qualname__, attrs, params, buffers))
    return tuple(out)


def representative_layers(model: GPTModel, layer_ids: range) -> tuple[list[int], dict[int, int]]:
    """The sublayers of a chunk worth tracing and, for every sublayer, the traced one that saves the same
    bytes in the same regions. Sublayer i's saved storages are those first saved during its forward:
    what it computes (its fingerprint) plus which of its inputs were saved before it, which depends on
    the sublayer before it (its output, or the embedding when i starts the chunk) and on the kinds of
    sublayer run before it (storages they share: rotary tables, the packed context). Sublayers equal in
    these three are traced once. The traced list keeps, in order, the first sublayer of every such
    class, the one before it, and the chunk's last (whose output the final norm reads) unless the list
    already ends with its twin."""
    ids = list(layer_ids)
    fps = {i: _module_fingerprint(model.layers[i]) for i in ids}
    rep: dict[int, int] = {}
    first_of: dict[Hashable, int] = {}
    seen: set = set()
    for k, i in enumerate(ids):
        sig = (fps[i], fps[ids[k - 1]] if k else None, frozenset(seen))
        rep[i] = first_of.setdefault(sig, i)
        seen.add(fps[i])
    keep = sorted(set(first_of.values()) | {ids[ids.index(r) - 1] for r in first_of.values() if r != ids[0]})
    if keep and fps[keep[-1]] != fps[ids[-1]]:
        keep.append(ids[-1])
    return keep, rep


def trace_chunk(model: GPTModel, chunk: Chunk, whole: bool, batch: int, seq: int,
                loss_vocab_factor: int = 1, full_trace: bool = False) -> dict[Hashable, int]:
    """Saved-tensor bytes by region of one micro-batch (batch, seq) through `chunk` of `model`
    (fake tensors). `loss_vocab_factor` widens the logits the loss sees (TP without loss_parallel
    all-gathers them to the full vocabulary). Only `representative_layers` run; every other sublayer
    is given its representative's bytes (`full_trace`: run them all, the reference)."""
    if full_trace:
        traced, rep = list(chunk.layer_ids), {i: i for i in chunk.layer_ids}
    else:
        traced, rep = representative_layers(model, chunk.layer_ids)
    regions = _trace(model, chunk, traced, whole, batch, seq, loss_vocab_factor)
    out = {region: nbytes for region, nbytes in regions.items() if not isinstance(region, tuple)}
    for i in chunk.layer_ids:
        for kind in ("seq", "mixer"):
            if (kind, rep[i]) in regions:
                out[(kind, i)] = regions[(kind, rep[i])]
    return out


def _trace(model: GPTModel, chunk: Chunk, traced: list[int], whole: bool, batch: int, seq: int,
           loss_vocab_factor: int) -> dict[Hashable, int]:
    tracker = RegionTracker(model)
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    labels, loss_mask = torch.zeros_like(tokens), torch.ones(batch, seq)  # the loader's dtypes
    # the same model with only the traced sublayers (the modules are shared: the tracker's hooks fire)
    runs = copy.copy(model)
    runs._modules = dict(model._modules)
    runs._modules["layers"] = nn.ModuleList([model.layers[i] for i in traced])
    try:
        with _FixedParametersCounter(model, tracker.current) as counter:
            if whole:
                logits, mtp_logits = forward_for_loss(runs, tokens, PackedContext.for_tokens(tokens))
            else:
                logits, mtp_logits = _stage_forward(runs, chunk, tokens, traced), []
            if logits is not None:
                if loss_vocab_factor > 1:
                    logits = torch.cat([logits] * loss_vocab_factor, dim=-1)  # what the all-gather produces
                with tracker.at("loss"):
                    combine_losses(logits, mtp_logits, labels, loss_mask, None, model.cfg)
            return dict(counter.by_region)
    finally:
        tracker.remove()


def _stage_forward(model: GPTModel, chunk: Chunk, tokens: torch.Tensor,
                   layer_ids: list[int]) -> Optional[torch.Tensor]:
    """Run one pipeline stage module; a later stage receives hidden states that require grad."""
    from meshtron.parallel.pipeline_stages import PipelineStageModule

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the stage deep-copies the rotary buffer: a fake tensor
        stage = PipelineStageModule(model, range(len(layer_ids)), chunk.is_first, chunk.is_last)
    stage.rotary = model.rotary  # that copy belongs to another fake mode; the model's own computes the same
    if stage.tied_copy:  # the last stage's copy of a tied embedding is a parameter (rank_parameters), not an activation
        stage.embedding = model.embedding
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    x = tokens if chunk.is_first else torch.zeros(*tokens.shape, model.cfg.hidden_size, requires_grad=True)
    out = stage(x, positions)
    return out if chunk.is_last else None


def recomputed(mode: str, symbol: str) -> bool:
    """Whether `apply_activation_checkpoint` wraps a sublayer of this symbol."""
    return mode == "full" or (mode == "selective" and symbol in SELECTIVE)


def chunk_activation_bytes(regions: dict[Hashable, int], chunk: Chunk, cfg: RunConfig, dims: ParallelDims,
                           batch: int, seq: int) -> int:
    """Scale the traced regions by the layout: under sequence parallelism the norm/residual regions
    hold 1/tp of the sequence; a recomputed sublayer keeps only its input (batch, seq[/tp], hidden)."""
    sp = dims.tp if dims.tp > 1 and cfg.parallel.sequence_parallel else 1
    mode = cfg.parallel.activation_checkpoint
    total = 0
    for region, nbytes in regions.items():
        kind, index = region if isinstance(region, tuple) else (region, None)
        if index is not None and recomputed(mode, cfg.model.pattern[index]):
            continue
        total += nbytes // sp if kind in ("seq", "head_seq") else nbytes
    inputs = sum(1 for i in chunk.layer_ids if recomputed(mode, cfg.model.pattern[i]))
    return total + inputs * batch * (seq // sp) * cfg.model.hidden_size * FP32_BYTES


@contextmanager
def fake_tensors(precision: str) -> Iterator[None]:
    """Fake CPU tensors: meta storage (no allocation) that dispatch like real ones. Plain meta
    tensors would send attention to the math kernel, which saves the full score matrix; training
    runs a fused kernel that saves q, k, v, the output and the log-sum-exp."""
    with fake_tensor_mode(), torch.device("cpu"):
        if precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                yield
        else:
            yield


# ---- the plan -------------------------------------------------------------------------------------

def vocab_size(cfg: RunConfig) -> int:
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size
    from meshtron.data.tokenizer import build_tokenizer

    return build_tokenizer(cfg.tokenizer).vocab_size


def num_microbatches(cfg: RunConfig, dims: ParallelDims) -> int:
    t = cfg.train
    if t.global_batch_size % (t.micro_batch_size * dims.dp):
        raise ConfigError(f"train.global_batch_size: {t.global_batch_size} is not allowed; must be a multiple of "
                          f"micro_batch_size * data-parallel size = {t.micro_batch_size} * {dims.dp}")
    return t.global_batch_size // (t.micro_batch_size * dims.dp)


def parameter_layout(cfg: RunConfig, world_size: int, tp_rank: int = 0) -> list[dict[str, Any]]:
    """One row per parameter of the model: name, shape, tp placement (None: a plain, whole tensor) and
    tp_local_shape, what tp rank `tp_rank` holds after `apply_tp` (before FSDP and expert parallelism)."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    with torch.device("meta"):
        model = GPTModel(cfg.model, vocab_size(cfg))
    placements = {}
    if dims.tp > 1:
        check_tp_divisibility(model, dims.tp)
        placements = tp_placements(model, sequence_parallel=cfg.parallel.sequence_parallel,
                                   loss_parallel=cfg.parallel.loss_parallel)
    return [{"name": name, "shape": tuple(p.shape), "tp_placement": placements.get(name),
             "tp_local_shape": tp_local_shape(p.shape, placements.get(name), dims.tp, tp_rank)}
            for name, p in model.named_parameters()]


def estimate_memory(cfg: RunConfig, world_size: int) -> list[dict[str, Any]]:
    """Bytes per pipeline rank (one dict per rank role; one without a pipeline), from the config alone.

    With t = tp, f = dp_shard * cp (FSDP's shard degree), b = micro-batch size, s = sequence length,
    m = micro-batches per step and pipeline = global_batch / (b * dp_replicate * dp_shard):
      params      = 4 * sum over the rank's parameters of ceil(rows_t / f) * rest_t, where the
                    TP-local shape is read off `tp_placements` (the ParallelStyles apply_tp applies:
                    column-parallel weights split on dim 0, row-parallel ones on dim 1, embeddings on
                    the vocabulary, norms and row-parallel biases whole); FSDP pads dim 0 (ceil).
                    Under expert parallelism a routed expert weight (experts, ...) holds experts / ep
                    of them, split over dp_shard * cp / ep more (dim 0 if even, else dim 1), and is
                    not split over tp unless expert_tensor_parallel (then its ffn width / tp); the
                    shared experts are column/row-parallel like the MLP.
      grads       = params (fp32, sharded like the parameters), except that under TP without FSDP
                    the embedding gradients are whole tables: DTensor's backward of a vocabulary-
                    parallel embedding returns them Replicate (measured on torch 2.13).
      optimizer   = Adam: 2 * params + 4 bytes (step) per tensor; SGD with momentum: params; else 0.
      activations = A * k, where A (per micro-batch) is the bytes of the distinct storages autograd
                    saves in one forward of (b, s / cp) tokens through the rank's chunks, traced on
                    fake tensors of the TP-local model (heads, MLP width and vocabulary / t), with
                    the norm/residual storages / t under sequence parallelism, the logits at the
                    full vocabulary for TP without loss_parallel, and a recomputed sublayer ('full':
                    all, 'selective': attention) counted as its input b * s[/t] * hidden * 4 only.
                    k = micro-batches in flight on pipeline rank r: 1 without a pipeline; GPipe m;
                    1F1B min(m, pp - r); interleaved 1F1B min(m*v, (v-1)*pp + 2*(pp-1-r) + 1) / v
                    chunk-micro-batches of 1/v of the rank each; zero-bubble min(m, pp) (ZB-V keeps
                    pp micro-batches of both its chunks on every rank).
      total       = params + grads + optimizer + activations.
    MoE sublayers trace a balanced dropless routing: under EP each rank's experts then receive as
    many rows as it sends, so the traced activations hold for any ep.
    Identical sublayers are traced once (`representative_layers`: same modules, same sublayer before
    them, same kinds run before them) and their bytes reused.
    Not counted: FSDP's transiently gathered sublayer parameters, communication buffers, ring
    attention's extra key/value blocks under CP, and the one sublayer recompute materialises during
    its backward. bf16 traces under CPU autocast; parameters, gradients and states stay fp32.
    """
    return _estimate_memory(cfg, world_size)


def _estimate_memory(cfg: RunConfig, world_size: int, full_trace: bool = False) -> list[dict[str, Any]]:
    """`estimate_memory`; `full_trace` traces every sublayer (the reference the fast path is tested against)."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    m = num_microbatches(cfg, dims)
    vocab = vocab_size(cfg)
    with torch.device("meta"):
        full = GPTModel(cfg.model, vocab)
    if dims.tp > 1:
        check_tp_divisibility(full, dims.tp)
    etp = cfg.parallel.expert_tensor_parallel and dims.tp > 1
    if dims.ep > 1 or etp:
        from meshtron.parallel.expert_parallel import check_ep_divisibility, check_etp

        check_ep_divisibility(full, dims.ep)
        if etp:
            check_etp(full, dims.tp)
    chunks_by_rank = rank_chunks(cfg, dims)
    batch, seq = cfg.train.micro_batch_size, cfg.data.seq_length // dims.cp
    loss_factor = dims.tp if dims.tp > 1 and not cfg.parallel.loss_parallel else 1
    with fake_tensors(cfg.train.precision):
        local = GPTModel(local_model_config(cfg, full.vocab_size, dims.tp, etp), vocab)
        plans = []
        for pp_rank, chunks in enumerate(chunks_by_rank):
            whole = dims.pp == 1
            per_microbatch = sum(chunk_activation_bytes(trace_chunk(local, c, whole, batch, seq, loss_factor, full_trace),
                                                        c,
                                                        cfg, dims, batch, seq) for c in chunks)
            sizes = rank_parameters(full, chunks, dims, etp)
            plans.append(_stage_plan(cfg, dims, pp_rank, chunks, sizes, per_microbatch, m))
    return plans


def _stage_plan(cfg: RunConfig, dims: ParallelDims, pp_rank: int, chunks: list[Chunk],
                sizes: list[tuple[str, int, int]], per_microbatch: int, m: int) -> dict[str, Any]:
    in_flight = microbatches_in_flight(cfg, dims, pp_rank, m)
    numels = [n for _, n, _ in sizes]
    params = FP32_BYTES * sum(numels)
    row = {
        "stage": pp_rank,
        "sublayers": ",".join(f"{c.layer_ids.start}-{c.layer_ids.stop - 1}" for c in chunks),
        "num_params": sum(numels),
        "param_bytes": params,
        "grad_bytes": FP32_BYTES * sum(g for _, _, g in sizes),
        "optimizer_bytes": optimizer_bytes(cfg, numels),
        "activation_bytes_per_microbatch": per_microbatch,
        "microbatches_in_flight": in_flight,
        "activation_bytes": int(round(per_microbatch * in_flight)),
    }
    row["total_bytes"] = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"] + row["activation_bytes"]
    return row
