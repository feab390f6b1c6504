"""CUDA graphs: one graph per (query count, key length) bucket, replayed instead of launching every kernel.

A step is padded to the smallest bucket that holds it, in two fixed-shape layouts:
- decode-only (every chunk one sampling token): D rows of one token, D the smallest of
  `cuda_graph_batch_sizes` >= the decodes; each row reads K key blocks, K the smallest key bucket
  >= the longest context's blocks (rows layout);
- with prefills: one packed row of T tokens, T the smallest of `cuda_graph_token_sizes` >= the
  step's tokens, reading K key blocks, K the smallest key bucket >= the sum of the chunks' context
  blocks (each request's own keys; the mask keeps requests apart).
Key buckets are `cuda_graph_key_sizes` (tokens) below max_model_len, plus max_model_len, in whole
blocks. A replay copies (gathers) only its bucket's K blocks per row and layer, not max_model_len's.
Anything no bucket holds runs eagerly (also a step with more prefill chunks than the largest of
`cuda_graph_prefill_sizes`, or whose keys pass max_model_len: the packed row's attention over more
keys than one full context costs more than the eager varlen path saves). Padding tokens write only
the scratch slot and attend only their row's first key; padded key blocks read the scratch block and
are masked. A bucket's inputs are static buffers: a step copies its layout into them and replays,
and the rows to sample are picked from the graph's logits outside it.

Every bucket the engine can use (`capture_list`) is captured at start-up, largest first into one
memory pool, after an eager warm-up forward on a side stream (which also allocates the KV cache).
Suspend drops them (the cache tensors they point at are freed); the first step after a resume
captures them all again. A model whose forward syncs with the host cannot be captured: the engine
refuses it at start-up with one line (a MoE model says so).

Graphs replay these layouts whatever `engine.decode_attention` is: its choice (flex, the CUDA
default, included) serves the eager varlen steps, those no bucket holds. FlexAttention is not
captured: its BlockMask's block lists change size every step, which a fixed-shape replay cannot hold.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.inference.config import EngineConfig
from meshtron.inference.paged_context import PagedBatch, PagedContext, PagedKVCache, build_paged_batch
from meshtron.inference.scheduler import ScheduledChunk

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

STATIC_FIELDS = ("positions", "write_slots", "key_blocks", "key_positions", "key_seq", "query_seq")


@dataclass(frozen=True)
class GraphBucket:
    num_tokens: int  # decode-only: rows of one token; with prefills: the tokens of the one packed row
    num_key_blocks: int  # key blocks each row reads
    is_decode_only: bool

    @property
    def num_rows(self) -> int:
        return self.num_tokens if self.is_decode_only else 1


@dataclass(frozen=True)
class BucketSizes:
    """The sizes a step is padded to, sorted; key sizes in blocks."""

    decodes: tuple[int, ...]
    tokens: tuple[int, ...]
    key_blocks: tuple[int, ...]
    max_prefills: int

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> BucketSizes:
        """Buckets the engine can use: none past the step limits (max_num_seqs decodes,
        max_num_batched_tokens tokens) but the first that holds them, keys up to max_model_len."""
        assert cfg.max_model_len is not None, "resolve() the config first"
        return cls(usable(cfg.cuda_graph_batch_sizes, cfg.max_num_seqs),
                   usable(cfg.cuda_graph_token_sizes, cfg.max_num_batched_tokens),
                   key_block_buckets(cfg.cuda_graph_key_sizes, cfg.block_size, cfg.max_model_len),
                   max(cfg.cuda_graph_prefill_sizes))


def usable(sizes: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """`sizes` up to the first that holds `limit` (larger ones are never chosen)."""
    ordered = sorted(set(sizes))
    cap = bucket_for(limit, tuple(ordered))
    return tuple(s for s in ordered if cap is None or s <= cap)


def key_block_buckets(key_sizes: tuple[int, ...], block_size: int, max_model_len: int) -> tuple[int, ...]:
    """Key buckets in whole blocks: the sizes below max_model_len, and max_model_len itself."""
    blocks = {-(-k // block_size) for k in key_sizes if k < max_model_len}
    return tuple(sorted(blocks | {-(-max_model_len // block_size)}))


def is_decode(chunk: ScheduledChunk) -> bool:
    return len(chunk.token_ids) == 1 and chunk.samples


def is_decode_only(chunks: list[ScheduledChunk]) -> bool:
    return all(is_decode(c) for c in chunks)


def bucket_for(count: int, buckets: tuple[int, ...]) -> Optional[int]:
    """The smallest bucket that holds `count`, or None when none does."""
    fitting = [b for b in sorted(buckets) if b >= count]
    return fitting[0] if fitting else None


def context_blocks(chunk: ScheduledChunk, block_size: int) -> int:
    """Key blocks the chunk reads: its whole context up to its last token."""
    return -(-(chunk.start_pos + len(chunk.token_ids)) // block_size)


def select_bucket(chunks: list[ScheduledChunk], sizes: BucketSizes, block_size: int) -> Optional[GraphBucket]:
    """The bucket a step is padded to, or None (run eagerly) when no bucket holds it."""
    if is_decode_only(chunks):
        rows = bucket_for(len(chunks), sizes.decodes)
        keys = bucket_for(max(context_blocks(c, block_size) for c in chunks), sizes.key_blocks)
        return GraphBucket(rows, keys, True) if rows is not None and keys is not None else None
    if sum(not is_decode(c) for c in chunks) > sizes.max_prefills:
        return None
    tokens = bucket_for(sum(len(c.token_ids) for c in chunks), sizes.tokens)
    keys = bucket_for(sum(context_blocks(c, block_size) for c in chunks), sizes.key_blocks)
    return GraphBucket(tokens, keys, False) if tokens is not None and keys is not None else None


def capture_list(sizes: BucketSizes) -> list[GraphBucket]:
    """Every bucket a step can map to, largest first (smaller graphs reuse the larger ones' pool)."""
    buckets = [GraphBucket(d, k, True) for d in sizes.decodes for k in sizes.key_blocks]
    buckets += [GraphBucket(t, k, False) for t in sizes.tokens for k in sizes.key_blocks]
    return sorted(buckets, key=lambda b: (b.num_tokens * b.num_key_blocks, b.num_tokens), reverse=True)


def pad_to_bucket(chunks: list[ScheduledChunk], cache: PagedKVCache, bucket: GraphBucket) -> PagedBatch:
    """The step laid out in the bucket's fixed shapes."""
    if bucket.is_decode_only:
        return build_paged_batch(chunks, cache, "rows", num_rows=bucket.num_tokens,
                                 num_key_blocks=bucket.num_key_blocks)
    return build_paged_batch(chunks, cache, "packed", num_tokens=bucket.num_tokens,
                             num_key_blocks=bucket.num_key_blocks)


def bucket_shapes(bucket: GraphBucket, block_size: int) -> dict[str, tuple[int, ...]]:
    """The static buffers' shapes of a bucket: tokens and every PagedContext input."""
    rows, q = bucket.num_rows, (1 if bucket.is_decode_only else bucket.num_tokens)
    keys = bucket.num_key_blocks * block_size
    return {"tokens": (rows, q), "positions": (rows, q), "write_slots": (rows * q,),
            "key_blocks": (rows, bucket.num_key_blocks), "key_positions": (rows, keys), "key_seq": (rows, keys),
            "query_seq": (rows, q)}


def replay_copy_bytes(bucket: GraphBucket, block_size: int, kv_bytes_per_token: int) -> int:
    """Bytes of keys and values one replay gathers from the cache over all layers (each row reads
    its bucket's key blocks), plus the static inputs it copies in (int64 each)."""
    gathered = bucket.num_rows * bucket.num_key_blocks * block_size * kv_bytes_per_token
    inputs = sum(torch.Size(shape).numel() for shape in bucket_shapes(bucket, block_size).values()) * 8
    return gathered + inputs


def blank_batch(bucket: GraphBucket, cache: PagedKVCache) -> PagedBatch:
    """A batch of the bucket's shapes holding only padding (captures record shapes, not values)."""
    shapes = bucket_shapes(bucket, cache.block_size)
    fill = {"tokens": 0, "positions": 0, "write_slots": cache.scratch_slot, "key_blocks": cache.scratch_block,
            "key_positions": 0, "key_seq": -1, "query_seq": -1}
    t = {name: torch.full(shape, fill[name], dtype=torch.long, device=cache.device) for name, shape in shapes.items()}
    ctx = PagedContext(**{name: t[name] for name in STATIC_FIELDS}, cache=cache)
    return PagedBatch(t["tokens"], ctx, torch.zeros(0, dtype=torch.long, device=cache.device), [])


def declared_host_syncs(model: nn.Module) -> list[str]:
    """What the model's MoE sublayers say makes them read the device on the host (their dtype and device)."""
    reasons: list[str] = []
    for layer in getattr(model, "layers", []):
        mixer = getattr(layer, "mixer", None)
        if getattr(layer, "symbol", None) == "E" and hasattr(mixer, "host_sync_reasons"):
            weight = next(mixer.parameters())
            reasons += [r for r in mixer.host_sync_reasons(weight.dtype, weight.device) if r not in reasons]
    return reasons


def refusal(model: nn.Module, error: BaseException) -> ConfigError:
    """One line: the model's forward cannot be captured (a host sync), why, and what to do."""
    moe = any(getattr(layer, "symbol", None) == "E" for layer in getattr(model, "layers", []))
    what = "its MoE layers sync with the host" if moe else "its forward syncs with the host"
    declared = declared_host_syncs(model) if moe else []
    reason = declared[0] if declared else (str(error).strip().splitlines() or [type(error).__name__])[0]
    return ConfigError(f"engine.cuda_graphs: this model cannot be captured in a CUDA graph ({what}: {reason}); "
                       "serve it without cuda_graphs")


class _Graph:
    """One captured forward over static copies of a padded batch's inputs; its logits (rows, q, vocab)."""

    def __init__(self, model: nn.Module, first: PagedBatch, pool):
        cache = first.ctx.cache
        self.tokens = first.tokens.clone()
        self.ctx = PagedContext(**{name: getattr(first.ctx, name).clone() for name in STATIC_FIELDS}, cache=cache)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: allocates the cache and lets kernels pick algorithms
            model(self.tokens, self._fresh_ctx())  # writes the same keys/values the replay writes
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model(self.tokens, self._fresh_ctx())

    def _fresh_ctx(self) -> PagedContext:
        return PagedContext(**{name: getattr(self.ctx, name) for name in STATIC_FIELDS}, cache=self.ctx.cache)

    def replay(self, batch: PagedBatch) -> torch.Tensor:
        self.tokens.copy_(batch.tokens)
        for name in STATIC_FIELDS:
            getattr(self.ctx, name).copy_(getattr(batch.ctx, name))
        self.graph.replay()
        return self.logits


class CudaGraphRunner:
    def __init__(self, model: nn.Module, cache: PagedKVCache, cfg: EngineConfig):
        self.model, self.cache = model, cache
        self.sizes = BucketSizes.from_config(cfg)
        self.graphs: dict[GraphBucket, _Graph] = {}
        self.pool = None

    @classmethod
    def create(cls, model: nn.Module, cache: PagedKVCache, cfg: EngineConfig) -> Optional[CudaGraphRunner]:
        """A graph runner on CUDA with every bucket captured; None (eager everywhere) on any other device."""
        if cache.device.type != "cuda" or not torch.cuda.is_available():
            warnings.warn("engine.cuda_graphs needs a CUDA device; running eagerly", stacklevel=2)
            return None
        if cfg.layout == "varlen":
            logging.getLogger("meshtron.engine").info(
                "engine.cuda_graphs: replays gather each row's key blocks in fixed shapes (FlexAttention is not "
                "captured: its block lists change size every step); engine.decode_attention serves steps no bucket holds")
        runner = cls(model, cache, cfg)
        runner.capture_all()
        return runner

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket of `capture_list`; a forward that cannot be captured is refused."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for bucket in capture_list(self.sizes):
            if bucket in self.graphs:
                continue
            try:
                self.graphs[bucket] = _Graph(self.model, blank_batch(bucket, self.cache), self.pool)
            except Exception as e:  # a host sync inside the capture (nonzero, .item(), .tolist(), ...)
                self.release()
                raise refusal(self.model, e) from e

    def select(self, chunks: list[ScheduledChunk]) -> Optional[GraphBucket]:
        return select_bucket(chunks, self.sizes, self.cache.block_size)

    def run(self, chunks: list[ScheduledChunk]) -> Optional[tuple[torch.Tensor, list[str]]]:
        """-> (logits (num_sampling, vocab), req ids), or None when no graph fits this batch."""
        bucket = self.select(chunks)
        if bucket is None:
            return None
        if not self.graphs:  # the first step after a resume: the cache was freed, capture again
            self.capture_all()
        batch = pad_to_bucket(chunks, self.cache, bucket)
        logits = self.graphs[bucket].replay(batch)
        return logits.reshape(-1, logits.shape[-1])[batch.sample_index], batch.sample_req_ids

    def release(self) -> None:
        self.graphs.clear()
        self.pool = None
