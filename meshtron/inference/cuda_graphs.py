"""CUDA graphs for decode steps: one graph per batch bucket, replayed instead of launching every kernel.

A decode-only step (every scheduled chunk is one token that samples) with R requests is padded to
the smallest bucket B >= R from `cuda_graph_batch_sizes`, in the padded layout with the key
dimension fixed at the longest context (max_model_len rounded up to whole blocks), so each
bucket's shapes never change. The bucket's input tensors are static buffers: a step copies its
tokens, positions and slot indices into them and replays. Padding rows write only the scratch
slot and attend only it. Anything else (a prefill chunk, more requests than the largest bucket)
runs eagerly. Graphs are captured lazily, the first time a bucket is needed, after one eager
warm-up forward (which also allocates the KV cache outside the capture). Suspend drops them: the
cache tensors they point at are freed.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from meshtron.inference.config import EngineConfig
from meshtron.inference.paged_context import PagedContext, PagedKVCache, build_paged_batch
from meshtron.inference.scheduler import ScheduledChunk

STATIC_FIELDS = ("positions", "write_slots", "key_blocks", "key_positions", "key_seq", "query_seq")


def is_decode_only(chunks: list[ScheduledChunk]) -> bool:
    return all(len(c.token_ids) == 1 and c.samples for c in chunks)


def bucket_for(num_requests: int, buckets: tuple[int, ...]) -> Optional[int]:
    """The smallest bucket that holds `num_requests`, or None when none does."""
    fitting = [b for b in sorted(buckets) if b >= num_requests]
    return fitting[0] if fitting else None


class _Graph:
    """One captured forward: static inputs (a PagedContext over fixed buffers) and its logits."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, num_rows: int, num_key_blocks: int, pool):
        device = cache.device
        self.tokens = torch.zeros(num_rows, 1, dtype=torch.long, device=device)
        num_keys = num_key_blocks * cache.block_size
        self.ctx = PagedContext(
            positions=torch.zeros(num_rows, 1, dtype=torch.long, device=device),
            write_slots=torch.full((num_rows,), cache.scratch_slot, dtype=torch.long, device=device),
            key_blocks=torch.full((num_rows, num_key_blocks), cache.scratch_block, dtype=torch.long, device=device),
            key_positions=torch.zeros(num_rows, num_keys, dtype=torch.long, device=device),
            key_seq=torch.full((num_rows, num_keys), -1, dtype=torch.long, device=device),
            query_seq=torch.full((num_rows, 1), -1, dtype=torch.long, device=device), cache=cache)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: allocates the cache and lets kernels pick algorithms
            model(self.tokens, self._fresh_ctx())
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model(self.tokens, self.ctx)  # (num_rows, 1, vocab)

    def _fresh_ctx(self) -> PagedContext:
        return PagedContext(**{name: getattr(self.ctx, name) for name in STATIC_FIELDS}, cache=self.ctx.cache)

    def replay(self, tokens: torch.Tensor, ctx: PagedContext) -> torch.Tensor:
        self.tokens.copy_(tokens)
        for name in STATIC_FIELDS:
            getattr(self.ctx, name).copy_(getattr(ctx, name))
        self.graph.replay()
        return self.logits[:, 0]


class CudaGraphRunner:
    def __init__(self, model: nn.Module, cache: PagedKVCache, cfg: EngineConfig):
        self.model, self.cache = model, cache
        self.buckets = tuple(sorted(set(cfg.cuda_graph_batch_sizes)))
        self.num_key_blocks = -(-cfg.max_model_len // cfg.block_size)
        self.graphs: dict[int, _Graph] = {}
        self.pool = None

    @classmethod
    def create(cls, model: nn.Module, cache: PagedKVCache, cfg: EngineConfig) -> Optional[CudaGraphRunner]:
        """A graph runner on CUDA; None (eager everywhere) on any other device."""
        if cache.device.type != "cuda" or not torch.cuda.is_available():
            warnings.warn("engine.cuda_graphs needs a CUDA device; running eagerly", stacklevel=2)
            return None
        return cls(model, cache, cfg)

    def run(self, chunks: list[ScheduledChunk]) -> Optional[tuple[torch.Tensor, list[str]]]:
        """-> (logits (num_requests, vocab), req ids), or None when no graph fits this batch."""
        bucket = bucket_for(len(chunks), self.buckets)
        if bucket is None or not is_decode_only(chunks):
            return None
        if bucket not in self.graphs:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            self.graphs[bucket] = _Graph(self.model, self.cache, bucket, self.num_key_blocks, self.pool)
        batch = build_paged_batch(chunks, self.cache, "rows", num_rows=bucket, num_key_blocks=self.num_key_blocks)
        logits = self.graphs[bucket].replay(batch.tokens, batch.ctx)
        return logits[: len(chunks)], batch.sample_req_ids

    def release(self) -> None:
        self.graphs.clear()
        self.pool = None
