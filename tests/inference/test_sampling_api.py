"""The rest of the sampling API (issue 17) against independent references: top-k then top-p and the
repetition penalty against transformers' logits processors on the same logits, presence/frequency
penalties against a naive loop over vLLM's definitions, logit bias and min_tokens end to end."""

from __future__ import annotations

import pytest
import torch

from meshtron.inference.request import InvalidRequestError, Request, SamplingParams
from meshtron.inference.sampler import filter_rows, process_rows, sample_rows
from tests.inference.helpers import TOKENIZER, engine, tiny_model

logits_process = pytest.importorskip("transformers.generation.logits_process")


def test_top_p_applies_to_what_top_k_kept():
    # the example: top_k=2 then top_p=0.5 on [0.35, 0.30, 0.20, 0.15] keeps one token
    logits = torch.tensor([[0.35, 0.30, 0.20, 0.15]]).log()
    kept = torch.isfinite(filter_rows(logits, [SamplingParams(top_k=2, top_p=0.5)]))
    assert kept.tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("top_k, top_p", [(8, 0.6), (3, 0.9), (20, 0.3), (0, 0.7), (5, 1.0)])
def test_top_k_top_p_match_transformers(top_k, top_p):
    torch.manual_seed(top_k)
    logits = torch.randn(64, 50) * 2
    ours = torch.isfinite(filter_rows(logits, [SamplingParams(top_k=top_k, top_p=top_p)] * 64))
    theirs = logits.clone()
    if top_k:
        theirs = logits_process.TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = logits_process.TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(ours, torch.isfinite(theirs))


def request_with(prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    request = Request("r", prompt, params, eos_token_id=TOKENIZER.eod_id)
    request.output_token_ids = list(output)
    return request


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(1)
    logits = torch.randn(1, 40) * 3
    prompt, output = [3, 7, 7, 12], [12, 30, 1]
    params = SamplingParams(repetition_penalty=1.7)
    ours = process_rows(logits, [params], [request_with(prompt, output, params)])
    theirs = logits_process.RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    assert torch.allclose(ours, theirs, atol=0, rtol=1e-6)


def test_presence_and_frequency_penalties_naive():
    torch.manual_seed(2)
    logits = torch.randn(2, 30)
    prompt, output = [5, 5, 9], [9, 9, 4, 17, 9]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()]
    ours = process_rows(logits, params, [request_with(prompt, output, params[0]), request_with(prompt, output, params[1])])
    expected = logits.clone()
    for token in set(output):  # vLLM: output tokens only; presence once, frequency per occurrence
        expected[0, token] -= 0.5 + 0.25 * output.count(token)
    assert torch.allclose(ours, expected, atol=1e-6) and torch.equal(ours[1], logits[1])


@pytest.fixture(scope="module")
def model():
    return tiny_model("gqa-rope")


def test_logit_bias_forces_and_bans(model):
    eng = engine(model, num_blocks=64, block_size=4)
    forced = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.9, seed=0, logit_bias={65: 100}))
    assert forced[0].token_ids == [65] * 5
    plain = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0].token_ids
    banned = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                      logit_bias={t: -100 for t in set(plain)}))[0].token_ids
    assert not set(banned) & set(plain)


def test_min_tokens_masks_eos_until_reached(model):
    eng = engine(model, num_blocks=64, block_size=4)
    eos = TOKENIZER.eod_id
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=10, temperature=0, min_tokens=3, logit_bias={eos: 100}))[0]
    assert out.token_ids[-1] == eos and len(out.token_ids) == 4 and out.finish_reason == "stop"


def test_penalties_change_greedy_output_as_the_reference_loop(model):
    """Greedy with a frequency penalty against a naive full-recompute loop applying the definition."""
    prompt, steps, penalty = [10, 11, 12], 8, 1.5
    ids, expected = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids]))[0, -1].float().clone()
            for token in set(expected):
                logits[token] -= penalty * expected.count(token)
            expected.append(int(logits.argmax()))
            ids.append(expected[-1])
    eng = engine(model, num_blocks=64, block_size=4)
    out = eng.generate([prompt], SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True,
                                                frequency_penalty=penalty))[0]
    assert out.token_ids == expected


@pytest.mark.parametrize("params, param", [
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(repetition_penalty=1e-300), "repetition_penalty"),
    (SamplingParams(repetition_penalty=1e300), "repetition_penalty"),
    (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    (SamplingParams(logit_bias={3: 101.0}), "logit_bias"),
    (SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
])
def test_processor_params_are_checked(model, params, param):
    with pytest.raises(InvalidRequestError) as err:
        engine(model, num_blocks=32, block_size=4).make_request([1, 2], params)
    assert err.value.param == param


def test_raw_log_probs_ignore_the_bias():
    logits = torch.randn(1, 20)
    params = [SamplingParams(temperature=0, return_log_probs=True, logit_bias={4: 100})]
    out = sample_rows(logits, params, [torch.Generator()], ["r"], [None])["r"]
    assert out.token_id == 4 and out.log_probs.log_prob == pytest.approx(float(logits[0].log_softmax(-1)[4]))
