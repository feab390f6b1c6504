"""Prompt log probs (issue 17) against the model's own full forward over the whole prompt (no cache,
no chunks): under chunked prefill, prefix caching, preemption, and with max_tokens=0."""

from __future__ import annotations

import pytest
import torch

from meshtron.inference.request import InvalidRequestError, SamplingParams
from tests.inference.helpers import engine, tiny_model, workload


@pytest.fixture(scope="module")
def model():
    return tiny_model("gqa-rope")


@torch.no_grad()
def reference(model, prompt: list[int], k: int) -> list[tuple[float, list[int]]]:
    """For each prompt position after the first: its log prob and the ids of the k most likely tokens."""
    log_probs = model(torch.tensor([prompt]))[0].float().log_softmax(-1)
    return [(float(log_probs[p - 1, prompt[p]]), log_probs[p - 1].topk(k).indices.tolist() if k else [])
            for p in range(1, len(prompt))]


def check(out, model, prompt, k, atol=1e-5):
    assert out.prompt_log_probs[0] is None and len(out.prompt_log_probs) == len(prompt)
    for lp, (value, top_ids), token in zip(out.prompt_log_probs[1:], reference(model, prompt, k), prompt[1:]):
        assert lp.token_id == token and lp.log_prob == pytest.approx(value, abs=atol)
        assert [i for i, _ in lp.top] == top_ids


def test_scoring_without_generating(model):
    prompts, _ = workload(num_requests=6, max_prompt=40)
    prompts = [p for p in prompts if len(p) > 1]
    eng = engine(model, num_blocks=128, block_size=4)
    outs = eng.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=3))
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == [] and out.finish_reason == "length"
        check(out, model, prompt, 3)
    assert eng.kv.num_free_blocks == 128


@pytest.mark.parametrize("layout", ["varlen", "packed", "padded", "auto"])
def test_chunked_prefill_and_generation_together(model, layout):
    prompt = list(range(1, 60))
    eng = engine(model, num_blocks=128, block_size=4, max_num_batched_tokens=16, layout=layout)  # four chunks
    out = eng.generate([prompt], SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=0, ignore_eos=True))[0]
    check(out, model, prompt, 0)
    assert len(out.token_ids) == 5


def test_a_cached_prefix_keeps_its_log_probs(model):
    prompt = list(range(3, 43))
    eng = engine(model, num_blocks=128, block_size=4, enable_prefix_caching=True)
    eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # fills the prefix cache
    plain = eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.num_cached_tokens > 0  # the cache is used by a request that does not score
    scored = eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0]
    check(scored, model, prompt, 2)


def test_preemption_keeps_the_log_probs(model):
    prompts, _ = workload(num_requests=8, max_prompt=30, seed=3)
    prompts = [p for p in prompts if len(p) > 1]
    # a cache too small for all of them at once: requests are preempted and recomputed
    eng = engine(model, num_blocks=24, block_size=4, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=1, ignore_eos=True)
    outs = eng.generate(prompts, params)
    assert sum(e.kind.value == "preempted" for o in outs for e in o.events) > 0
    for out, prompt in zip(outs, prompts):
        check(out, model, prompt, 1)


def test_max_tokens_zero_needs_prompt_logprobs(model):
    with pytest.raises(InvalidRequestError) as err:
        engine(model, num_blocks=32, block_size=4).make_request([1, 2], SamplingParams(max_tokens=0))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as err:
        engine(model, num_blocks=32, block_size=4).make_request([1, 2], SamplingParams(prompt_logprobs=21))
    assert err.value.param == "prompt_logprobs"
