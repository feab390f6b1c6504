"""Hostile or broken requests fail alone (issue 16): numbers refused at validation, and a request that
slips past it and breaks while admitted, sampled or detokenized ends with its own error while its
companions produce exactly the tokens of a full-recompute reference. A step that raises fails what
is in flight; an engine that cannot go on says why and fails later requests at once."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from meshtron.inference.engine import MAX_CONSECUTIVE_STEP_FAILURES
from meshtron.inference.request import InvalidRequestError, Request, SamplingParams
from meshtron.inference.sampler import sample_rows
from tests.inference.helpers import engine, reference_greedy, tiny_model

COMPANIONS = [[5, 6, 7], [40, 41], [9, 9, 9, 9, 1]]
TIMEOUT_S = 60  # a hang fails the test instead of stalling the suite


@pytest.fixture(scope="module")
def model():
    return tiny_model("gqa-rope")


@pytest.fixture(scope="module")
def expected(model):
    return [reference_greedy(model, p, 6) for p in COMPANIONS]


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("params, param", [
    (SamplingParams(seed=2**64), "seed"),  # the request: killed the engine loop
    (SamplingParams(seed=2**64 - 1 + 1), "seed"),  # seed 2**64-1 with n=2: choice 1 gets seed + 1
    (SamplingParams(seed=-(2**63) - 1), "seed"),
    (SamplingParams(seed=True), "seed"),
    (SamplingParams(temperature=1e-300), "temperature"),  # 0 in fp32: NaN probabilities for the whole batch
    (SamplingParams(temperature=math.inf), "temperature"),
    (SamplingParams(temperature=math.nan), "temperature"),
    (SamplingParams(top_p=math.nan), "top_p"),
    (SamplingParams(min_p=math.nan), "min_p"),
    (SamplingParams(max_tokens=True), "max_tokens"),
    (SamplingParams(max_tokens=2.0), "max_tokens"),
    (SamplingParams(top_k=1.5), "top_k"),
    (SamplingParams(stop_token_ids=(1.5,)), "stop_token_ids"),
    (SamplingParams(stop_token_ids=(True,)), "stop_token_ids"),
])
def test_out_of_range_numbers_are_refused(model, params, param):
    with pytest.raises(InvalidRequestError) as err:
        engine(model, num_blocks=32, block_size=4).make_request([1, 2], params)
    assert err.value.param == param


def test_seed_and_temperature_bounds_are_accepted(model):
    low, high = SamplingParams.SEED_RANGE
    eng = engine(model, num_blocks=64, block_size=4)
    for seed in (low, high, 0):
        torch.Generator().manual_seed(seed)  # the generator's own range: the bounds are usable
    outs = eng.generate([[1, 2]] * 3, [SamplingParams(max_tokens=2, seed=low),
                                       SamplingParams(max_tokens=2, seed=high),
                                       SamplingParams(max_tokens=2, temperature=SamplingParams.MIN_TEMPERATURE)])
    assert all(o.finish_reason == "length" and not o.error for o in outs)


def run_with(eng, hostile: Request, companions: list[list[int]]):
    """Stream the companions and the hostile request (which bypasses validation) together."""
    async def collect(request: Request):
        final = None
        async for out in eng.stream_request(request):
            final = out
        return final

    async def main():
        requests = [eng.make_request(p, greedy()) for p in companions]
        return await asyncio.wait_for(asyncio.gather(collect(hostile), *map(collect, requests)), TIMEOUT_S)

    try:
        return asyncio.run(main())
    finally:
        eng.shutdown()


def test_a_seed_the_generator_refuses_fails_alone(model, expected):
    eng = engine(model, num_blocks=64, block_size=4)
    hostile = Request("hostile", [3, 4], SamplingParams(max_tokens=4, seed=2**64))  # not validated
    bad, *good = run_with(eng, hostile, COMPANIONS)
    assert bad.finish_reason == "error" and "admitting failed" in bad.error
    assert [o.token_ids for o in good] == expected and not any(o.error for o in good)
    assert eng.fatal_error is None


def test_a_temperature_that_underflows_fails_alone(model, expected):
    eng = engine(model, num_blocks=64, block_size=4)
    hostile = Request("hostile", [3, 4], SamplingParams(max_tokens=4, temperature=1e-300))
    bad, *good = run_with(eng, hostile, COMPANIONS)
    assert bad.finish_reason == "error" and "not finite" in bad.error
    assert [o.token_ids for o in good] == expected and not any(o.error for o in good)
    assert eng.kv.num_free_blocks == 64


def test_a_request_whose_text_fails_fails_alone(model, expected):
    class Broken:  # a tokenizer bug or a corrupt vocabulary entry, hit by one request only
        def decode(self, ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    eng = engine(model, num_blocks=64, block_size=4)
    real_admit = eng._admit

    def admit(request):
        real_admit(request)
        if request.req_id == "hostile":
            eng._detokenizers["hostile"].tokenizer = Broken()

    eng._admit = admit
    bad, *good = run_with(eng, Request("hostile", [3, 4], greedy()), COMPANIONS)
    assert bad.finish_reason == "error" and "detokenizing failed: UnicodeDecodeError" in bad.error
    assert [o.token_ids for o in good] == expected and not any(o.error for o in good)


def test_rows_with_non_finite_logits_fail_alone():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8), SamplingParams(temperature=0),
              SamplingParams(temperature=0)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = sample_rows(logits, params, gens, ["a", "b", "c", "d"])
    assert out["b"].error and out["c"].error and not out["a"].error and not out["d"].error
    alone = sample_rows(logits[[0, 3]], [params[0], params[3]], [torch.Generator().manual_seed(i) for i in (0, 3)],
                        ["a", "d"])
    assert (out["a"].token_id, out["d"].token_id) == (alone["a"].token_id, alone["d"].token_id)
    assert out["d"].token_id == int(logits[3].argmax())


def test_a_failed_step_fails_what_is_in_flight_and_the_engine_serves_on(model, expected):
    eng = engine(model, num_blocks=64, block_size=4)
    real = eng.scheduler.update_from_output
    calls = {"n": 0}

    def flaky(sched, sampled):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("bookkeeping bug")
        return real(sched, sampled)

    eng.scheduler.update_from_output = flaky
    eng.start_background_loop()
    first = eng.generate([[3, 4]], greedy())[0]
    assert first.finish_reason == "error" and "the engine step failed: KeyError" in first.error
    again = eng.generate(COMPANIONS, greedy())
    assert [o.token_ids for o in again] == expected and eng.fatal_error is None
    eng.shutdown()
    assert eng.kv.num_free_blocks == 64


def test_an_engine_that_cannot_go_on_says_why_and_fails_new_requests(model):
    eng = engine(model, num_blocks=64, block_size=4)

    def broken():
        raise RuntimeError("scheduler state corrupted")

    eng.scheduler.schedule = broken
    eng.start_background_loop()

    async def one():
        async for out in eng.stream([1, 2], greedy()):
            final = out
        return final

    async def several():
        return [await one() for _ in range(MAX_CONSECUTIVE_STEP_FAILURES + 1)]

    outs = asyncio.run(asyncio.wait_for(several(), TIMEOUT_S))
    assert all(o.finish_reason == "error" for o in outs)
    assert all("the engine step failed: RuntimeError: scheduler state corrupted" in o.error for o in outs[:-1])
    assert eng.fatal_error is not None and "scheduler state corrupted" in eng.fatal_error
    assert outs[-1].error.startswith("the engine is not running")
    sync = eng.generate([[1, 2]], greedy())[0]  # the synchronous front is told too, never hangs
    assert sync.finish_reason == "error"
    eng.shutdown()
