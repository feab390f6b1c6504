"""CUDA graphs: one graph per batch-shape bucket, replayed instead of launching every kernel.

A step is classified by its token count t, its prefill chunks p (any chunk that is not a single
sampling token) and its decodes d, and padded to the smallest bucket that holds it:
- decode-only (p = 0): bucket (D, 0, D), D the smallest of `cuda_graph_batch_sizes` >= d, in the
  rows layout (one row per request, the key dimension fixed at the longest context,
  max_model_len rounded up to whole blocks);
- mixed (p > 0): bucket (T, P, D): T the smallest of `cuda_graph_token_sizes` >= t, P of
  `cuda_graph_prefill_sizes` >= p, D of `cuda_graph_batch_sizes` >= d (0 without decodes), in the
  packed layout: one row of T tokens whose keys are P + D whole contexts (each request's own keys,
  the mask keeps requests apart).
Anything no bucket holds runs eagerly. Padding tokens write only the scratch slot and attend only
their row's first key; padded key blocks read the scratch block and are masked. A bucket's input
tensors are static buffers: a step copies its layout into them and replays, and the rows to sample
are picked from the graph's logits outside it. Graphs are captured lazily, the first time a bucket
is needed, after one eager warm-up forward on a side stream (which also allocates the KV cache
outside the capture). Suspend drops them: the cache tensors they point at are freed.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from meshtron.inference.config import EngineConfig
from meshtron.inference.paged_context import PagedBatch, PagedContext, PagedKVCache, build_paged_batch
from meshtron.inference.scheduler import ScheduledChunk

STATIC_FIELDS = ("positions", "write_slots", "key_blocks", "key_positions", "key_seq", "query_seq")


@dataclass(frozen=True)
class GraphBucket:
    num_tokens: int  # padded token count of the forward
    num_prefills: int  # prefill chunks the bucket holds (0: decode-only)
    num_decodes: int  # single-token sampling chunks the bucket holds

    @property
    def is_decode_only(self) -> bool:
        return self.num_prefills == 0


def is_decode(chunk: ScheduledChunk) -> bool:
    return len(chunk.token_ids) == 1 and chunk.samples


def is_decode_only(chunks: list[ScheduledChunk]) -> bool:
    return all(is_decode(c) for c in chunks)


def bucket_for(count: int, buckets: tuple[int, ...]) -> Optional[int]:
    """The smallest bucket that holds `count`, or None when none does."""
    fitting = [b for b in sorted(buckets) if b >= count]
    return fitting[0] if fitting else None


def select_bucket(chunks: list[ScheduledChunk], decode_sizes: tuple[int, ...], token_sizes: tuple[int, ...],
                  prefill_sizes: tuple[int, ...]) -> Optional[GraphBucket]:
    """The bucket a step is padded to, or None (run eagerly) when no bucket holds it."""
    num_decodes = sum(is_decode(c) for c in chunks)
    num_prefills = len(chunks) - num_decodes
    if num_prefills == 0:
        size = bucket_for(num_decodes, decode_sizes)
        return GraphBucket(size, 0, size) if size is not None else None
    num_tokens = bucket_for(sum(len(c.token_ids) for c in chunks), token_sizes)
    prefills = bucket_for(num_prefills, prefill_sizes)
    decodes = 0 if num_decodes == 0 else bucket_for(num_decodes, decode_sizes)
    if num_tokens is None or prefills is None or decodes is None:
        return None
    return GraphBucket(num_tokens, prefills, decodes)


def pad_to_bucket(chunks: list[ScheduledChunk], cache: PagedKVCache, bucket: GraphBucket,
                  max_key_blocks: int) -> PagedBatch:
    """The step laid out in the bucket's fixed shapes: decode-only (rows D, 1 token, max_key_blocks
    keys each); mixed (1 row of T tokens, (P + D) * max_key_blocks key blocks)."""
    if bucket.is_decode_only:
        return build_paged_batch(chunks, cache, "rows", num_rows=bucket.num_decodes, num_key_blocks=max_key_blocks)
    return build_paged_batch(chunks, cache, "packed", num_tokens=bucket.num_tokens,
                             num_key_blocks=(bucket.num_prefills + bucket.num_decodes) * max_key_blocks)


def bucket_shapes(bucket: GraphBucket, max_key_blocks: int, block_size: int) -> dict[str, tuple[int, ...]]:
    """The static buffers' shapes of a bucket: tokens and every PagedContext input."""
    if bucket.is_decode_only:
        rows, q, kb = bucket.num_decodes, 1, max_key_blocks
    else:
        rows, q, kb = 1, bucket.num_tokens, (bucket.num_prefills + bucket.num_decodes) * max_key_blocks
    return {"tokens": (rows, q), "positions": (rows, q), "write_slots": (rows * q,), "key_blocks": (rows, kb),
            "key_positions": (rows, kb * block_size), "key_seq": (rows, kb * block_size), "query_seq": (rows, q)}


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
        self.decode_sizes = tuple(sorted(set(cfg.cuda_graph_batch_sizes)))
        self.token_sizes = tuple(sorted(set(cfg.cuda_graph_token_sizes)))
        self.prefill_sizes = tuple(sorted(set(cfg.cuda_graph_prefill_sizes)))
        self.max_key_blocks = -(-cfg.max_model_len // cfg.block_size)
        self.graphs: dict[GraphBucket, _Graph] = {}
        self.pool = None

    @classmethod
    def create(cls, model: nn.Module, cache: PagedKVCache, cfg: EngineConfig) -> Optional[CudaGraphRunner]:
        """A graph runner on CUDA; None (eager everywhere) on any other device."""
        if cache.device.type != "cuda" or not torch.cuda.is_available():
            warnings.warn("engine.cuda_graphs needs a CUDA device; running eagerly", stacklevel=2)
            return None
        return cls(model, cache, cfg)

    def select(self, chunks: list[ScheduledChunk]) -> Optional[GraphBucket]:
        return select_bucket(chunks, self.decode_sizes, self.token_sizes, self.prefill_sizes)

    def run(self, chunks: list[ScheduledChunk]) -> Optional[tuple[torch.Tensor, list[str]]]:
        """-> (logits (num_sampling, vocab), req ids), or None when no graph fits this batch."""
        bucket = self.select(chunks)
        if bucket is None:
            return None
        batch = pad_to_bucket(chunks, self.cache, bucket, self.max_key_blocks)
        if bucket not in self.graphs:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            self.graphs[bucket] = _Graph(self.model, batch, self.pool)
        logits = self.graphs[bucket].replay(batch)
        return logits.reshape(-1, logits.shape[-1])[batch.sample_index], batch.sample_req_ids

    def release(self) -> None:
        self.graphs.clear()
        self.pool = None
