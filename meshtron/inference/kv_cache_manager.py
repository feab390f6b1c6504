"""Per-request block tables over the block pool: allocation for new tokens, prefix-cache hits, freeing.

Token i of a request lives in slot i % block_size of block `block_ids[i // block_size]`. A
request's full blocks are hashed from its token ids (prompt and outputs alike) and, once their
keys/values are computed, registered in the pool's prefix cache; a later request (or the same
one recomputed after preemption) whose tokens start the same way reuses those blocks instead of
computing them. Only full blocks are ever shared, and shared blocks are never written again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from meshtron.inference.block_pool import BlockPool, hash_block
from meshtron.inference.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_block_ids: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}  # hashes of a request's full blocks, in order
        self._num_registered: dict[str, int] = {}  # leading blocks already in the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, req_id: str) -> list[int]:
        return self.req_block_ids.get(req_id, [])

    def _hashes(self, request: Request) -> list[bytes]:
        """Hashes of every full block of the request's current tokens (extended as tokens arrive)."""
        hashes = self._req_hashes.setdefault(request.req_id, [])
        num_full = request.num_tokens // self.block_size
        bs = self.block_size
        for i in range(len(hashes), num_full):
            tokens = [request.token_at(j) for j in range(i * bs, (i + 1) * bs)]
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
        return hashes

    def get_computed_blocks(self, request: Request, max_tokens: Optional[int] = None) -> tuple[list[int], int]:
        """Cached blocks that hold the request's leading tokens -> (block ids, tokens they cover).

        The last token is never taken from the cache: the step must compute it to get the logits
        that sample the next token. `max_tokens` caps the hit further (tokens whose logits are needed).
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = min(request.num_tokens - 1, request.num_tokens if max_tokens is None else max_tokens) \
            // self.block_size
        hits = []
        for block_hash in self._hashes(request)[:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus any prefix hits).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        current = self.req_block_ids.get(request.req_id, [])
        num_computed = request.num_computed_tokens + len(computed_block_ids) * self.block_size
        num_total_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        num_needed = max(0, num_total_blocks - len(current) - len(computed_block_ids))
        # hit blocks nobody holds sit in the free queue: taking them shrinks what is left to allocate
        num_free_hits = sum(1 for b in computed_block_ids if self.pool.blocks[b].ref_count == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return False
        self.pool.touch(computed_block_ids)
        self.req_block_ids[request.req_id] = current + list(computed_block_ids) + self.pool.allocate(num_needed)
        if computed_block_ids:
            self._num_registered[request.req_id] = len(computed_block_ids)
        return True

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full of computed keys/values in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_registered.get(request.req_id, 0)
        if num_full <= start:
            return
        hashes, block_ids = self._hashes(request), self.req_block_ids[request.req_id]
        for i in range(start, num_full):
            self.pool.cache(block_ids[i], hashes[i])
        self._num_registered[request.req_id] = num_full

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Return the blocks past the first `num_tokens` tokens (speculative decoding: the slots of
        rejected drafts). Trailing blocks are never full of computed tokens, so never cached."""
        block_ids = self.req_block_ids.get(req_id, [])
        keep = -(-num_tokens // self.block_size)
        if len(block_ids) > keep:
            self.pool.free(reversed(block_ids[keep:]))
            self.req_block_ids[req_id] = block_ids[:keep]

    def free(self, request: Request, finished: bool = True) -> None:
        """Return the request's blocks (last first). A preempted request keeps its hashes for later."""
        block_ids = self.req_block_ids.pop(request.req_id, [])
        self.pool.free(reversed(block_ids))
        self._num_registered.pop(request.req_id, None)
        if finished:
            self._req_hashes.pop(request.req_id, None)

    def reset(self) -> None:
        """Drop every table and the prefix cache (suspend: the tensors behind the blocks are gone)."""
        self.req_block_ids.clear()
        self._req_hashes.clear()
        self._num_registered.clear()
        self.pool.reset()
