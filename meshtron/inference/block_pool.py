"""The KV block pool: block ids, reference counts, a free queue, and the prefix-cache index by content hash.

Only ids live here; the tensors behind them belong to the model runner. Invariants:
- a block is in the free queue exactly when its reference count is 0;
- a free block may still hold cached content (it has a hash and is findable by `lookup`) until it is
  handed out again, which evicts it: the free queue is the eviction order (front first);
- blocks freed without content go to the front (nothing worth keeping), blocks with content to the
  back, so cached prefixes survive as long as possible.
A block's hash chains the hash of the block before it with its own token ids, so equal hashes
mean equal whole prefixes, not just equal blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free (the scheduler checks first; this is a bug guard)."""


def hash_block(parent_hash: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """Content hash of one full block, chained on the previous block's hash."""
    h = hashlib.blake2b(parent_hash or b"root", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[bytes] = None


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, counting cached blocks nobody references."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next handed out) first."""
        return list(self._free)

    def ref_counts(self) -> list[int]:
        return [b.ref_count for b in self.blocks]

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` blocks from the front of the free queue, evicting their cached content."""
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
            block.block_hash = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each block (a prefix-cache hit); a free one leaves the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in the order given (callers pass a sequence's blocks
        last-first, so the end of a sequence is evicted before its shared beginning)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than it was taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self._cached.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Make a full block findable by its hash; False if another block already holds that content."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset(self) -> None:
        """Forget all cached content and restore the initial free queue (every block must be free)."""
        busy = [b.block_id for b in self.blocks if b.ref_count]
        assert not busy, f"reset with blocks still referenced: {busy[:8]}"
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
