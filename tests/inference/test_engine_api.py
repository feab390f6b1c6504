"""Engine behaviour around the numbers: seeded sampling independent of batch companions, validation
errors carrying request ids, streaming from inside a running event loop, aborts freeing blocks,
stop strings, log probabilities and lifecycle events."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from meshtron.inference.request import InvalidRequestError, RequestStatus, SamplingParams
from meshtron.inference.sampler import filter_rows
from tests.inference.helpers import TOKENIZER, engine, tiny_model, workload


@pytest.fixture(scope="module")
def model():
    return tiny_model("gqa-rope")


def test_seeded_sampling_ignores_batch_companions(model):
    prompts, _ = workload(num_requests=9)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, seed=11)
    alone = engine(model, num_blocks=256, block_size=4).generate([prompts[0]], [params])[0].token_ids
    others = [SamplingParams(max_tokens=8 + i, temperature=1.3 - 0.1 * i, top_p=0.8, seed=i) for i in range(8)]
    crowd = engine(model, num_blocks=256, block_size=4, max_num_batched_tokens=16)
    together = crowd.generate(prompts[1:5] + [prompts[0]] + prompts[5:], others[:4] + [params] + others[4:])
    assert together[4].token_ids == alone
    different_seed = engine(model, num_blocks=256, block_size=4).generate(
        [prompts[0]], [SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, seed=12)])
    assert different_seed[0].token_ids != alone


def test_filters_per_row():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.5), SamplingParams(min_p=0.5)]
    kept = torch.isfinite(filter_rows(logits, params)).tolist()
    assert kept == [[True, True, False, False], [True, False, False, False], [False, False, False, True]]


@pytest.mark.parametrize("params, prompt, param", [
    (SamplingParams(max_tokens=0), [1, 2], "max_tokens"),
    (SamplingParams(max_tokens=-3), [1, 2], "max_tokens"),
    (SamplingParams(max_tokens=95), [1, 2], "max_tokens"),  # prompt + max tokens over 96
    (SamplingParams(temperature=-0.5), [1], "temperature"),
    (SamplingParams(top_p=0.0), [1], "top_p"),
    (SamplingParams(top_p=1.5), [1], "top_p"),
    (SamplingParams(top_k=-1), [1], "top_k"),
    (SamplingParams(min_p=2.0), [1], "min_p"),
    (SamplingParams(return_log_probs=True, top_log_probs=99), [1], "top_log_probs"),
    (SamplingParams(), [], "prompt"),
    (SamplingParams(), "", "prompt"),
    (SamplingParams(), [100000], "prompt"),
])
def test_invalid_requests_fail_alone(model, params, prompt, param):
    eng = engine(model, num_blocks=64, block_size=4)
    good = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(prompt, params, req_id="bad-1")
    assert err.value.req_id == "bad-1" and err.value.param == param and "bad-1" in str(err.value)
    outputs = []
    while eng.has_unfinished_requests():
        outputs += eng.step()
    assert [o.req_id for o in outputs if o.finished] == [good]


def test_stream_inside_a_running_loop_and_abort_frees_blocks(model):
    eng = engine(model, num_blocks=64, block_size=4)

    async def main():
        pieces = []
        async for out in eng.stream([1, 2, 3], SamplingParams(max_tokens=6, temperature=0)):
            pieces.append(out)
        agen = eng.stream([4, 5, 6, 7, 8], SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
        first = await agen.__anext__()
        await agen.aclose()  # the client went away
        for _ in range(200):
            if eng.kv.num_free_blocks == 64 and not eng.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return pieces, first

    pieces, first = asyncio.run(main())
    assert pieces[-1].finished and sum(len(p.new_token_ids) for p in pieces) == len(pieces[-1].token_ids)
    assert not first.finished
    assert eng.kv.num_free_blocks == 64 and not eng.has_unfinished_requests()
    eng.shutdown()


def test_another_thread_gets_the_lock_between_two_steps(model):
    """The background loop hands the lock over after each step. With a plain lock CPython lets the
    loop re-acquire at once, and a drain's `abort_all` waited out whole requests (a CI failure)."""
    eng = engine(model, num_blocks=64, block_size=4)
    eng.step_hook = lambda kind, *payload: time.sleep(0.02) if kind == "step" else None
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    eng.start_background_loop()
    try:
        while eng.num_steps < 3:
            time.sleep(0.005)
        waited = []
        for _ in range(10):  # each acquisition: at most the step that holds the lock, and the next never starts
            before = eng.num_steps
            with eng._lock:
                waited.append(eng.num_steps - before)
        assert max(waited) <= 1, waited
        before = eng.num_steps
        assert eng.abort_all("drain") == 1 and eng.num_steps - before <= 1
        assert not eng.has_unfinished_requests() and eng.kv.num_free_blocks == 64
    finally:
        eng.shutdown()


def test_generate_while_the_background_loop_runs(model):
    eng = engine(model, num_blocks=64, block_size=4)
    eng.start_background_loop()
    try:
        outs = eng.generate([[1, 2], [3, 4, 5]], SamplingParams(max_tokens=4, temperature=0))
    finally:
        eng.shutdown()
    direct = engine(model, num_blocks=64, block_size=4).generate([[1, 2], [3, 4, 5]],
                                                                 SamplingParams(max_tokens=4, temperature=0))
    assert [o.token_ids for o in outs] == [o.token_ids for o in direct]


def test_stop_strings_log_probs_and_events(model):
    eng = engine(model, num_blocks=64, block_size=4)
    free = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = free.text[3:5]
    assert len(stop) == 2
    cut = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=30, temperature=0, stop=(stop,), ignore_eos=True,
                                                   return_log_probs=True, top_log_probs=3))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]
    assert len(cut.log_probs) == len(cut.token_ids)
    first = cut.log_probs[0]
    assert first.token_id == cut.token_ids[0] and first.top[0][0] == first.token_id  # greedy: the top token
    assert first.top[0][1] == pytest.approx(first.log_prob) and len(first.top) == 3
    assert [e.kind.value for e in cut.events] == ["added", "scheduled", "finished"]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    assert TOKENIZER.decode(free.token_ids) == free.text


def test_generate_inside_a_running_loop_before_and_after_a_stream(model):
    """A notebook cell or a web handler: `generate` from an `async def`, first while no background
    thread exists, then after a stream started one; outputs equal the plain call's."""
    prompts = [[1, 2], [3, 4, 5], [9, 8, 7, 6, 5, 4]]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    plain = [o.token_ids for o in engine(model, num_blocks=64, block_size=4).generate(prompts, params)]
    eng = engine(model, num_blocks=64, block_size=4)

    async def main():
        before = eng.generate(prompts, params)
        streamed = [out async for out in eng.stream([1, 2], params)]
        assert eng._thread is not None  # the background loop now steps
        after = eng.generate(prompts, params)
        seeded = SamplingParams(max_tokens=5, temperature=0.8, seed=3)
        return before, streamed, after, eng.generate(prompts[1], seeded)

    try:
        before, streamed, after, seeded = asyncio.run(main())
    finally:
        eng.shutdown()
    assert [o.token_ids for o in before] == plain
    assert [o.token_ids for o in after] == plain
    assert streamed[-1].token_ids == plain[0]
    alone = engine(model, num_blocks=64, block_size=4).generate(prompts[1], SamplingParams(
        max_tokens=5, temperature=0.8, seed=3))
    assert seeded[0].token_ids == alone[0].token_ids
    assert eng.kv.num_free_blocks == 64


def test_abort_and_fail_events_in_order_with_timestamps(model):
    eng = engine(model, num_blocks=64, block_size=4)
    rid = eng.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    request = eng.scheduler.requests[rid]
    eng.step()
    eng.step()
    before = time.monotonic()
    assert eng.abort(rid, "client went away") and not eng.abort(rid)
    assert [e.kind.value for e in request.events] == ["added", "scheduled", "aborted"]
    stamps = [e.timestamp for e in request.events]
    assert stamps == sorted(stamps) and stamps[-1] >= before
    assert request.status == RequestStatus.FINISHED_ABORTED and request.error == "client went away"
    assert len(request.output_token_ids) == 2 and eng.kv.num_free_blocks == 64

    # a forward that raises fails that step's requests (and only them); the engine serves on
    working = eng.runner.execute

    def broken(sched):
        raise RuntimeError("device lost")

    eng.runner.execute = broken
    ids = [eng.add_request(p, SamplingParams(max_tokens=4, temperature=0)) for p in ([7, 8], [9, 10, 11])]
    failed_requests = [eng.scheduler.requests[i] for i in ids]
    outs = eng.step()
    eng.runner.execute = working
    assert [o.req_id for o in outs] == ids
    for out, req in zip(outs, failed_requests):
        assert out.finished and out.finish_reason == "error" and out.error == "the forward failed: RuntimeError: device lost"
        assert [e.kind.value for e in out.events] == ["added", "scheduled", "failed"]
        assert [e.timestamp for e in out.events] == sorted(e.timestamp for e in out.events)
        assert req.status == RequestStatus.FINISHED_FAILED
    assert eng.kv.num_free_blocks == 64 and not eng.has_unfinished_requests()
    params = SamplingParams(max_tokens=4, temperature=0)
    again = eng.generate([[7, 8]], params)[0].token_ids
    assert again == engine(model, num_blocks=64, block_size=4).generate([[7, 8]], params)[0].token_ids
