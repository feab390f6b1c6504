"""Block pool and KV cache manager: exact block ids, reference counts and free queues after scripted
sequences of allocate / share / free / evict."""

from __future__ import annotations

import pytest

from meshtron.inference.block_pool import BlockPool, NoFreeBlocksError, hash_block
from meshtron.inference.kv_cache_manager import KVCacheManager
from meshtron.inference.request import Request, SamplingParams


def test_allocate_free_order_and_ref_counts():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert (a, b) == ([0, 1], [2, 3, 4])
    assert pool.free_block_ids() == [5] and pool.ref_counts() == [1, 1, 1, 1, 1, 0]
    pool.touch([1])  # shared
    pool.free(reversed(a))
    assert pool.ref_counts() == [0, 1, 1, 1, 1, 0]
    assert pool.free_block_ids() == [0, 5]  # content-less blocks go to the front
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.allocate(2) == [0, 5]


def test_cached_blocks_stay_findable_until_evicted():
    pool = BlockPool(4)
    ids = pool.allocate(3)  # [0, 1, 2]
    h0 = hash_block(None, [1, 2])
    h1 = hash_block(h0, [3, 4])
    assert pool.cache(0, h0) and pool.cache(1, h1)
    assert not pool.cache(2, h1)  # same content elsewhere: first holder keeps it
    pool.free(reversed(ids))  # 2 (no content) to the front; 1 then 0 to the back
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.lookup(h0) == 0 and pool.lookup(h1) == 1
    pool.touch([0])  # a prefix hit takes a free cached block back
    assert pool.free_block_ids() == [2, 3, 1] and pool.ref_counts() == [1, 0, 0, 0]
    assert pool.allocate(3) == [2, 3, 1]  # block 1 is evicted to be reused
    assert pool.lookup(h1) is None and pool.lookup(h0) == 0
    assert pool.num_cached_blocks == 1


def test_hash_chains_the_whole_prefix():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0, 0]), [1, 2])
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])


def request(req_id, tokens):
    return Request(req_id, tokens, SamplingParams(max_tokens=4))


def test_manager_share_free_evict_script():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = request("a", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 5)
    assert kv.block_ids("a") == [0, 1, 2]
    a.num_computed_tokens = 5
    kv.cache_blocks(a)  # blocks 0 and 1 are full: cached; block 2 holds one token
    assert kv.pool.num_cached_blocks == 2
    b = request("b", [1, 2, 3, 4, 9, 9])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([0, 1], 4)
    assert kv.allocate_slots(b, 2, hit_ids)
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.ref_counts()[:4] == [2, 2, 1, 1]
    kv.free(a)
    assert kv.pool.ref_counts()[:4] == [1, 1, 0, 1]
    assert kv.pool.free_block_ids() == [2, 4, 5, 6, 7]
    kv.free(b)
    assert kv.pool.ref_counts() == [0] * 8
    assert kv.pool.free_block_ids() == [3, 2, 4, 5, 6, 7, 1, 0]
    # a third request with the same prefix finds the blocks although nobody holds them
    c = request("c", [1, 2, 3, 4, 7])
    hit_ids, _ = kv.get_computed_blocks(c)
    assert hit_ids == [0, 1]
    # the pool has 8 free blocks but two of them are the hits: 6 more at most
    assert not kv.allocate_slots(c, 6 * 2 + 1, hit_ids)
    assert kv.allocate_slots(c, 1, hit_ids)
    assert kv.block_ids("c") == [0, 1, 3] and kv.pool.free_block_ids() == [2, 4, 5, 6, 7]


def test_full_prompt_hit_still_computes_the_last_token():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = request("a", [1, 2, 3, 4])
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    kv.cache_blocks(a)
    b = request("b", [1, 2, 3, 4])
    assert kv.get_computed_blocks(b) == ([0], 2)  # not both blocks: the last token must run


def test_no_prefix_caching():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = request("a", [1, 2, 3, 4])
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    kv.cache_blocks(a)
    assert kv.pool.num_cached_blocks == 0 and kv.get_computed_blocks(request("b", [1, 2, 3])) == ([], 0)
