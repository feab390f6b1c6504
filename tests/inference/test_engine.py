"""The batched engine against the one-at-a-time full-recompute reference, token for token: plain,
chunked prefill, prefix-cache hits, preemption, suspend/resume, every layout and attention kind."""

from __future__ import annotations

import pytest

from meshtron.inference.request import SamplingParams
from tests.inference.helpers import engine, greedy_params, reference_greedy, tiny_model, workload


@pytest.fixture(scope="module")
def model():
    return tiny_model("gqa-rope")


@pytest.fixture(scope="module")
def reference(model):
    prompts, max_tokens = workload()
    return prompts, max_tokens, [reference_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]


def run(eng, prompts, max_tokens):
    return [o.token_ids for o in eng.generate(prompts, greedy_params(max_tokens))]


def test_batched_greedy_equals_reference(model, reference):
    prompts, max_tokens, expected = reference
    eng = engine(model, block_size=4, num_blocks=512)
    assert run(eng, prompts, max_tokens) == expected
    assert eng.kv.num_free_blocks == 512  # everything returned
    assert eng.runner.num_forwards["varlen"] > 0  # the default layout


def test_decode_buckets_bound_padding():
    from meshtron.inference.varlen_context import BUCKET_RATIO, _decode_buckets

    lengths = [1, 16, 3, 12, 9, 2, 16, 7, 4, 11]
    buckets = _decode_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for b in buckets:
        assert all(BUCKET_RATIO * lengths[b[0]] <= lengths[i] <= lengths[b[0]] for i in b)
    assert [[lengths[i] for i in b] for b in buckets] == [[16, 16, 12], [11, 9], [7], [4, 3], [2], [1]]


def test_chunked_prefill(model, reference):
    prompts, max_tokens, expected = reference
    eng = engine(model, block_size=4, num_blocks=512, max_num_batched_tokens=7, max_num_seqs=5)
    assert run(eng, prompts, max_tokens) == expected


@pytest.mark.parametrize("layout", ["auto", "packed", "padded"])
def test_each_layout(model, reference, layout):
    prompts, max_tokens, expected = reference
    assert run(engine(model, block_size=8, num_blocks=256, layout=layout), prompts, max_tokens) == expected


@pytest.mark.parametrize("segment_len", [1, 3, 16])
def test_rows_of_segments(model, reference, segment_len, monkeypatch):
    """Chunks cut into rows of a fixed length give the reference tokens too."""
    from meshtron.inference import runner

    monkeypatch.setattr(runner, "choose_layout", lambda chunks, weights: ("rows", segment_len))
    prompts, max_tokens, expected = reference
    eng = engine(model, block_size=4, num_blocks=512, max_num_batched_tokens=37, layout="auto")
    assert run(eng, prompts, max_tokens) == expected


def test_prefix_cache_hits(model):
    prompts, max_tokens = workload(num_requests=12, shared_prefix=13, max_prompt=10, max_output=6)
    expected = [reference_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    eng = engine(model, block_size=4, num_blocks=256, max_num_seqs=4)
    outputs = eng.generate(prompts, greedy_params(max_tokens))
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.num_cached_tokens for o in outputs) >= 12 * (8 - 3)  # later requests reuse >= 2 blocks
    again = eng.generate(prompts[:3], greedy_params(max_tokens[:3]))  # whole prompts cached now
    assert [o.token_ids for o in again] == expected[:3]
    assert all(o.num_cached_tokens >= 12 for o in again)


def test_preemption_recomputes_the_same_tokens(model, reference):
    prompts, max_tokens, expected = reference
    eng = engine(model, block_size=4, num_blocks=24, max_num_seqs=16, max_num_batched_tokens=32)
    outputs = eng.generate(prompts, greedy_params(max_tokens))
    assert [o.token_ids for o in outputs] == expected
    preempted = sum(1 for o in outputs for e in o.events if e.kind.value == "preempted")
    assert preempted > 0
    assert eng.kv.num_free_blocks == 24


def test_suspend_resume_gives_the_uninterrupted_outputs(model, reference):
    prompts, max_tokens, expected = reference
    eng = engine(model, block_size=4, num_blocks=512, max_num_seqs=8)
    params = greedy_params(max_tokens)
    params[0] = SamplingParams(max_tokens=20, temperature=1.0, seed=3)  # a sampled request too
    sampled = engine(model, block_size=4, num_blocks=512).generate([prompts[0]], [params[0]])[0].token_ids
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    finished = {}
    for step in range(12):
        finished.update({o.req_id: o for o in eng.step() if o.finished})
        if step == 5:
            eng.suspend()
            assert eng.runner.cache.num_bytes == 0 and eng.kv.num_free_blocks == 512
            assert eng.step() == []  # nothing runs while suspended
            eng.resume()
    while eng.has_unfinished_requests():
        finished.update({o.req_id: o for o in eng.step() if o.finished})
    assert finished[ids[0]].token_ids == sampled
    assert [finished[i].token_ids for i in ids[1:]] == expected[1:]


@pytest.mark.parametrize("kind", ["window-sinks-learned-pos", "mla", "moe"])
def test_attention_variants(kind):
    model = tiny_model(kind)
    prompts, max_tokens = workload(num_requests=10, max_prompt=20, max_output=10)
    expected = [reference_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    eng = engine(model, block_size=4, num_blocks=256, max_num_batched_tokens=9)
    assert run(eng, prompts, max_tokens) == expected
