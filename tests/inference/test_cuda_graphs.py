"""CUDA graphs: bucket choice by query count and key length, the eager fallback rule, the start-up
capture list, the bytes a replay copies (now O(bucket) instead of O(max_model_len)), the refusal of a
model whose forward cannot be captured, and the padded fixed-shape batches (whose logits must equal
the eager varlen forward's) on any machine; capture and replay against eager decoding only where CUDA
is available."""

from __future__ import annotations

import pytest
import torch

from meshtron.config.fields import ConfigError
from meshtron.inference import cuda_graphs
from meshtron.inference.config import EngineConfig
from meshtron.inference.cuda_graphs import (
    BucketSizes,
    CudaGraphRunner,
    GraphBucket,
    blank_batch,
    bucket_for,
    bucket_shapes,
    capture_list,
    is_decode_only,
    key_block_buckets,
    pad_to_bucket,
    replay_copy_bytes,
    select_bucket,
)
from meshtron.inference.paged_context import PagedKVCache
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
    return ScheduledChunk(name, list(range(1, num_tokens + 1)), start, list(range(64)), samples=samples)


# block size 4, max_model_len 96: key buckets 8, 16, 32 tokens -> 2, 4, 8 blocks, plus 96 -> 24 blocks
SIZES = BucketSizes(decodes=(1, 2, 4, 8), tokens=(16, 32), key_blocks=key_block_buckets((8, 16, 32), 4, 96),
                    max_prefills=2)


def test_key_block_buckets():
    assert key_block_buckets((8, 16, 32), 4, 96) == (2, 4, 8, 24)
    assert key_block_buckets((8, 16, 200), 4, 96) == (2, 4, 24)  # sizes past max_model_len dropped
    assert key_block_buckets((10,), 4, 10) == (3,)  # max_model_len in whole blocks


def test_buckets_by_rows_and_key_length():
    # decodes whose longest context is 10 tokens (start 9 + 1): 3 blocks -> the 4-block (16-key) bucket
    assert select_bucket([chunk(f"d{i}", 1, 9) for i in range(3)], SIZES, 4) == GraphBucket(4, 4, True)
    assert select_bucket([chunk("d", 1, 2)], SIZES, 4) == GraphBucket(1, 2, True)  # 3 keys: 2 blocks
    assert select_bucket([chunk("d", 1, 40), chunk("e", 1, 0)], SIZES, 4) == GraphBucket(2, 24, True)
    # with prefills: one packed row; keys are the sum of the chunks' contexts (3 + 3 + 3 + 3 blocks)
    decodes = [chunk(f"d{i}", 1, 9) for i in range(3)]
    assert select_bucket(decodes + [chunk("p", 10)], SIZES, 4) == GraphBucket(16, 24, False)
    assert select_bucket([chunk("p", 16)], SIZES, 4) == GraphBucket(16, 4, False)
    assert select_bucket([chunk("p", 1, samples=False)], SIZES, 4) == GraphBucket(16, 2, False)
    # eager fallback: too many tokens, prefills, decodes or keys for every bucket
    assert select_bucket([chunk("p", 33)], SIZES, 4) is None
    assert select_bucket([chunk(x, 2) for x in "abc"], SIZES, 4) is None  # 3 prefills > 2
    assert select_bucket([chunk(f"d{i}", 1, 9) for i in range(9)], SIZES, 4) is None
    assert select_bucket([chunk("p", 8, 60), chunk("q", 8, 60)], SIZES, 4) is None  # 34 key blocks > 24


def test_bucket_shapes():
    assert bucket_shapes(GraphBucket(4, 6, True), 4) == {
        "tokens": (4, 1), "positions": (4, 1), "write_slots": (4,), "key_blocks": (4, 6), "key_positions": (4, 24),
        "key_seq": (4, 24), "query_seq": (4, 1)}
    mixed = bucket_shapes(GraphBucket(32, 36, False), 4)
    assert mixed["tokens"] == (1, 32) and mixed["write_slots"] == (32,) and mixed["key_blocks"] == (1, 36)
    batch = blank_batch(GraphBucket(32, 36, False), PagedKVCache(8, 4, torch.device("cpu")))
    assert tuple(batch.tokens.shape) == (1, 32) and bool((batch.ctx.write_slots == 32).all())  # the scratch slot


def resolved(**options) -> EngineConfig:
    return EngineConfig(**options).resolve(8192, 1)


def test_capture_list_from_the_config():
    """Captured at start-up: every bucket a step can use, none past the step limits, largest first."""
    cfg = resolved(block_size=16, max_num_seqs=20, max_num_batched_tokens=256, max_model_len=8192,
                   cuda_graph_batch_sizes=(1, 8, 32, 64), cuda_graph_token_sizes=(64, 256, 512),
                   cuda_graph_key_sizes=(1024, 4096, 16384))
    sizes = BucketSizes.from_config(cfg)
    assert sizes.decodes == (1, 8, 32) and sizes.tokens == (64, 256) and sizes.key_blocks == (64, 256, 512)
    buckets = capture_list(sizes)
    assert set(buckets) == {GraphBucket(d, k, True) for d in (1, 8, 32) for k in (64, 256, 512)} | {
        GraphBucket(t, k, False) for t in (64, 256) for k in (64, 256, 512)}
    assert len(buckets) == 15 and buckets[0] == GraphBucket(256, 512, False) and buckets[-1] == GraphBucket(1, 64, True)


def test_a_replay_copies_its_bucket_not_max_model_len():
    """An 8B-shaped model (32 layers, 8 KV heads of 128, bf16: 128 KiB of keys/values per token) at
    max_model_len 8192: 32 decodes with 600-token contexts. Before, every row read 8192 keys (32 GiB
    gathered per step, 1 GiB per layer); now the 1024-key bucket: 1/8 of it."""
    kv_per_token = 2 * 32 * 8 * 128 * 2
    cfg = resolved(block_size=16, max_model_len=8192, max_num_seqs=32)
    sizes = BucketSizes.from_config(cfg)
    bucket = select_bucket([chunk(f"d{i}", 1, 599) for i in range(32)], sizes, 16)
    assert bucket == GraphBucket(32, 1024 // 16, True)
    old = GraphBucket(32, 8192 // 16, True)  # the old decode graph: every row padded to max_model_len
    assert replay_copy_bytes(old, 16, kv_per_token) >= 32 * 2**30
    gathered = 32 * 1024 * kv_per_token
    assert replay_copy_bytes(bucket, 16, kv_per_token) == gathered + (4 * 32 + 32 * 64 + 2 * 32 * 1024) * 8
    assert replay_copy_bytes(bucket, 16, kv_per_token) < replay_copy_bytes(old, 16, kv_per_token) / 7.9


def test_a_forward_that_cannot_be_captured_is_refused(monkeypatch):
    """A host sync during capture (what MoE dispatch did) becomes one line at start-up, naming MoE."""
    model = tiny_model()
    cfg = resolved(block_size=4, max_model_len=32, cuda_graph_key_sizes=(8,), cuda_graph_batch_sizes=(1,),
                   cuda_graph_token_sizes=(8,))
    runner = CudaGraphRunner(model, PagedKVCache(8, 4, torch.device("cpu")), cfg)

    def sync(model, batch, pool):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(cuda_graphs, "_Graph", sync)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    with pytest.raises(ConfigError, match=r"^engine.cuda_graphs: this model cannot be captured in a CUDA graph \(its "
                                          r"forward syncs with the host: CUDA error: operation not permitted when "
                                          r"stream is capturing\); serve it without cuda_graphs$"):
        runner.capture_all()
    assert runner.graphs == {}
    model.layers[1].symbol = "E"  # reported as MoE when the model has MoE layers
    with pytest.raises(ConfigError, match="its MoE layers sync with the host: CUDA error"):
        runner.capture_all()


def test_a_moe_refusal_names_the_declared_reason(monkeypatch):
    """A MoE model whose capture fails: the line gives the reason its MoE layers declare."""
    model = tiny_model("moe")
    cfg = resolved(block_size=4, max_model_len=32, cuda_graph_key_sizes=(8,), cuda_graph_batch_sizes=(1,),
                   cuda_graph_token_sizes=(8,))
    runner = CudaGraphRunner(model, PagedKVCache(8, 4, torch.device("cpu")), cfg)
    monkeypatch.setattr(cuda_graphs, "_Graph", lambda *a: (_ for _ in ()).throw(RuntimeError("capture failed")))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    moe = next(layer.mixer for layer in model.layers if layer.symbol == "E")
    monkeypatch.setattr(moe, "host_sync_reasons", lambda dtype, device: ["the experts run as a loop"])
    with pytest.raises(ConfigError, match=r"\(its MoE layers sync with the host: the experts run as a loop\); "
                                          "serve it without cuda_graphs$"):
        runner.capture_all()


def test_every_bucket_is_captured_at_start_up(monkeypatch):
    captured = []

    class Recorded:
        def __init__(self, model, batch, pool):
            captured.append(tuple(batch.tokens.shape) + (batch.ctx.key_blocks.shape[1],))

    monkeypatch.setattr(cuda_graphs, "_Graph", Recorded)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    cfg = resolved(block_size=4, max_model_len=32, cuda_graph_key_sizes=(8,), cuda_graph_batch_sizes=(1, 2),
                   cuda_graph_token_sizes=(8,))
    runner = CudaGraphRunner(tiny_model(), PagedKVCache(8, 4, torch.device("cpu")), cfg)
    runner.capture_all()
    assert sorted(captured) == sorted([(1, 1, 2), (1, 1, 8), (2, 1, 2), (2, 1, 8), (1, 8, 2), (1, 8, 8)])
    assert set(runner.graphs) == set(capture_list(runner.sizes))


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
    sizes = BucketSizes((1, 2, 4, 8), (8, 16, 32), key_block_buckets((8, 16, 32), 4, eng.config.max_model_len), 4)
    for step in range(30):
        if step == 6:  # new prompts arrive while the first ones decode: mixed steps
            for i, p in enumerate(prompts[3:]):
                eng.add_request(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), req_id=f"s{i}")
        eng.step()
        if not eng.has_unfinished_requests():
            break
        chunks = steps[-1]
        bucket = select_bucket(chunks, sizes, 4)
        if bucket is None or not any(c.samples for c in chunks):
            continue
        seen.add("decode" if bucket.is_decode_only else "mixed" if any(map(cuda_graphs.is_decode, chunks))
                 else "prefill")
        ref_logits, ref_ids = eng.runner._forward(chunks)  # eager varlen; rewrites the same keys/values
        batch = pad_to_bucket(chunks, eng.runner.cache, bucket)
        shapes = bucket_shapes(bucket, 4)
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
                     cuda_graph_key_sizes=(16, 32), max_num_batched_tokens=64)
    captured = set(graphed.runner.graphs.graphs)
    assert captured == set(capture_list(graphed.runner.graphs.sizes))  # all at start-up, before any request
    outputs = graphed.generate(prompts, greedy_params(max_tokens))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    assert graphed.runner.num_forwards["graph"] > 0
    assert set(graphed.runner.graphs.graphs) == captured  # nothing captured during traffic
    graphed.suspend()  # graphs point at freed cache tensors: dropped, recaptured after resume
    assert graphed.runner.graphs.graphs == {}
    graphed.resume()
    again = graphed.generate(prompts[:4], greedy_params(max_tokens[:4]))
    assert [o.token_ids for o in again] == [o.token_ids for o in eager[:4]]
