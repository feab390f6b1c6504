"""Scheduler: the token budget across running and waiting requests, chunked prefill, FCFS
admission, and preemption of the latest arrival when blocks run out."""

from __future__ import annotations

from meshtron.inference.config import EngineConfig
from meshtron.inference.kv_cache_manager import KVCacheManager
from meshtron.inference.request import Request, RequestStatus, SamplingParams
from meshtron.inference.scheduler import SampledToken, Scheduler


def make(num_blocks=16, block_size=4, **options):
    cfg = EngineConfig(num_blocks=num_blocks, block_size=block_size, **options).resolve(64, 1)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


def req(req_id, n, max_tokens=8):
    return Request(req_id, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def advance(sched, out, token=7):
    return sched.update_from_output(out, {c.req_id: SampledToken(token) for c in out.chunks if c.samples})


def test_budget_chunks_a_long_prompt_and_keeps_decodes_flowing():
    sched = make(max_num_batched_tokens=8)
    sched.add_request(req("a", 3))
    sched.add_request(req("b", 13))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 3, "b": 5}
    assert [c.samples for c in out.chunks] == [True, False]
    assert out.chunks[1].start_pos == 0 and out.chunks[1].block_ids == [1, 2]
    advance(sched, out)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}  # a decodes, b continues at position 5
    assert out.chunks[1].start_pos == 5 and out.chunks[1].token_ids == list(range(6, 13))
    advance(sched, out)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.chunks[1].samples


def test_no_chunking_waits_for_a_whole_prompt():
    sched = make(max_num_batched_tokens=64, enable_chunked_prefill=False)
    sched.cfg.max_num_batched_tokens = 10  # smaller than a prompt: the prompt waits
    sched.add_request(req("a", 12))
    assert sched.schedule().is_empty


def test_max_num_seqs_and_fcfs():
    sched = make(max_num_seqs=2)
    for name in "abc":
        sched.add_request(req(name, 2))
    out = sched.schedule()
    assert [c.req_id for c in out.chunks] == ["a", "b"] and [r.req_id for r in sched.waiting] == ["c"]


def test_preempts_the_latest_arrival_and_requeues_it_first():
    sched = make(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    a, b = req("a", 3, max_tokens=20), req("b", 3, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    advance(sched, sched.schedule())  # a: blocks [0, 1], b: [2, 3]; each has 4 tokens, 3 computed
    out = sched.schedule()  # both decode into their second block: fits
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    advance(sched, out)
    out = sched.schedule()  # a needs a third block: none free, so b is preempted
    assert out.preempted_req_ids == ["b"] and out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and sched.kv.block_ids("b") == []
    # b's blocks hold the same tokens as a's, so they were never cached: freed last-first to the front
    assert sched.kv.pool.free_block_ids() == [3]
    assert sched.kv.block_ids("a") == [0, 1, 2]


def test_finish_frees_blocks_and_stops_on_eos():
    sched = make()
    r = req("a", 4)
    r.eos_token_id = 9
    sched.add_request(r)
    advance(sched, sched.schedule(), token=9)
    assert r.status == RequestStatus.FINISHED_STOPPED and sched.kv.num_free_blocks == 16
    assert sched.num_unfinished == 0
