"""CUDA graphs: bucket choice, the eager fallback rule and the padded fixed-shape batches (whose
logits must equal the eager varlen forward's) on any machine; capture and replay against eager
decoding only where CUDA is available."""

from __future__ import annotations

import pytest
import torch

from meshtron.inference.cuda_graphs import (
    GraphBucket,
    bucket_for,
    bucket_shapes,
    is_decode_only,
    pad_to_bucket,
    select_bucket,
)
from meshtron.inference.request import SamplingParams
from meshtron.inference.scheduler import ScheduledChunk
from tests.inference.helpers import engine, greedy_params, tiny_model, workload


def test_bucket_choice():
    assert bucket_for(1, (1, 2, 4, 8)) == 1
    assert bucket_for(3, (8, 4, 2, 1)) == 4
    assert bucket_for(9, (1, 2, 4, 8)) is None


def test_only_decode_batches_use_graphs():
    decode = ScheduledChunk("a", [5], 7, [0, 1], samples=True)
    prefill = ScheduledChunk("b", [1, 2, 3], 0, [2], samples=True)
    partial = ScheduledChunk("c", [4], 0, [3], samples=False)
    assert is_decode_only([decode]) and not is_decode_only([decode, prefill]) and not is_decode_only([partial])


def chunk(name: str, num_tokens: int, start: int = 0, samples: bool = True) -> ScheduledChunk:
    return ScheduledChunk(name, list(range(1, num_tokens + 1)), start, [0, 1, 2, 3], samples=samples)


SIZES = dict(decode_sizes=(1, 2, 4, 8), token_sizes=(16, 32), prefill_sizes=(1, 2))


def test_mixed_bucket_selection_and_fallback():
    decodes = [chunk(f"d{i}", 1, 9) for i in range(3)]
    assert select_bucket(decodes, **SIZES) == GraphBucket(4, 0, 4)
    assert select_bucket(decodes + [chunk("p", 10)], **SIZES) == GraphBucket(16, 1, 4)  # 13 tokens
    assert select_bucket(decodes + [chunk("p", 10), chunk("q", 6, samples=False)], **SIZES) == GraphBucket(32, 2, 4)
    assert select_bucket([chunk("p", 16)], **SIZES) == GraphBucket(16, 1, 0)  # no decodes: none padded in
    assert select_bucket([chunk("p", 1, samples=False)], **SIZES) == GraphBucket(16, 1, 0)  # a 1-token prefill
    # eager fallback: too many tokens, prefills or decodes for every bucket
    assert select_bucket([chunk("p", 33)], **SIZES) is None
    assert select_bucket([chunk(x, 2) for x in "abc"], **SIZES) is None
    assert select_bucket([chunk(f"d{i}", 1, 9) for i in range(9)], **SIZES) is None
    assert select_bucket([chunk(f"d{i}", 1, 9) for i in range(9)] + [chunk("p", 2)], **SIZES) is None


def test_bucket_shapes():
    assert bucket_shapes(GraphBucket(4, 0, 4), 6, 4) == {
        "tokens": (4, 1), "positions": (4, 1), "write_slots": (4,), "key_blocks": (4, 6), "key_positions": (4, 24),
        "key_seq": (4, 24), "query_seq": (4, 1)}
    mixed = bucket_shapes(GraphBucket(32, 2, 4), 6, 4)
    assert mixed["tokens"] == (1, 32) and mixed["write_slots"] == (32,) and mixed["key_blocks"] == (1, 36)


@torch.inference_mode()
def test_padded_buckets_give_the_eager_logits():
    """Steps of a real engine run (decode-only and mixed) padded to their buckets: shapes are the
    bucket's, padding writes only the scratch slot, and the sampled rows' logits equal the eager
    varlen forward of the same step."""
    model = tiny_model()
    eng = engine(model, num_blocks=128, block_size=4, max_num_batched_tokens=24)
    steps: list = []
    eng.step_hook = lambda kind, chunks=None: steps.append(chunks) if kind == "step" else None
    prompts, _ = workload(num_requests=6, max_prompt=20)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), req_id=f"r{i}")
    seen = set()
    max_key_blocks = -(-eng.config.max_model_len // 4)
    sizes = dict(decode_sizes=(1, 2, 4, 8), token_sizes=(8, 16, 32), prefill_sizes=(1, 2, 4))
    for step in range(30):
        if step == 6:  # new prompts arrive while the first ones decode: mixed steps
            for i, p in enumerate(prompts[3:]):
                eng.add_request(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), req_id=f"s{i}")
        eng.step()
        if not eng.has_unfinished_requests():
            break
        chunks = steps[-1]
        bucket = select_bucket(chunks, **sizes)
        if bucket is None or not any(c.samples for c in chunks):
            continue
        seen.add("decode" if bucket.is_decode_only else "mixed" if bucket.num_decodes else "prefill")
        ref_logits, ref_ids = eng.runner._forward(chunks)  # eager varlen; rewrites the same keys/values
        batch = pad_to_bucket(chunks, eng.runner.cache, bucket, max_key_blocks)
        shapes = bucket_shapes(bucket, max_key_blocks, 4)
        assert tuple(batch.tokens.shape) == shapes["tokens"]
        for name in ("positions", "write_slots", "key_blocks", "key_positions", "key_seq", "query_seq"):
            assert tuple(getattr(batch.ctx, name).shape) == shapes[name], name
        num_real = sum(len(c.token_ids) for c in chunks)
        pad_slots = batch.ctx.write_slots[batch.ctx.query_seq.reshape(-1) < 0]
        assert len(pad_slots) == batch.tokens.numel() - num_real
        assert bool((pad_slots == eng.runner.cache.scratch_slot).all())
        logits = model(batch.tokens, batch.ctx)
        assert batch.sample_req_ids == ref_ids
        torch.testing.assert_close(logits.reshape(-1, logits.shape[-1])[batch.sample_index], ref_logits,
                                   atol=1e-5, rtol=1e-5)
    assert seen == {"decode", "mixed", "prefill"}


def test_cuda_graphs_fall_back_to_eager_off_cuda():
    model = tiny_model()
    with pytest.warns(UserWarning, match="needs a CUDA device"):
        eng = engine(model, num_blocks=64, block_size=4, cuda_graphs=True, device="cpu")
    assert eng.runner.graphs is None
    assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0].finished


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_replay_matches_eager_on_cuda():
    model = tiny_model().cuda()
    prompts, max_tokens = workload(num_requests=12, max_prompt=20, max_output=16)
    eager = engine(model, num_blocks=256, block_size=4).generate(prompts, greedy_params(max_tokens))
    graphed = engine(model, num_blocks=256, block_size=4, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4, 16),
                     cuda_graph_token_sizes=(64, 128, 512), cuda_graph_prefill_sizes=(1, 2, 4, 12),
                     max_num_batched_tokens=64)
    outputs = graphed.generate(prompts, greedy_params(max_tokens))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    assert graphed.runner.num_forwards["graph"] > 0
    kinds = {b.is_decode_only for b in graphed.runner.graphs.graphs}
    assert kinds == {True, False}  # decode-only and mixed buckets were both captured and replayed
    graphed.suspend()  # graphs point at freed cache tensors: dropped, recaptured after resume
    assert graphed.runner.graphs.graphs == {}
    graphed.resume()
    again = graphed.generate(prompts[:4], greedy_params(max_tokens[:4]))
    assert [o.token_ids for o in again] == [o.token_ids for o in eager[:4]]
