"""The sampling API over HTTP (issue 17), in-process, against the model's own full forward: /v1/completions
echo with logprobs covers the prompt (first entry null) and then the completion, for text and token-id
prompts, lists of prompts, n > 1 and streams; max_tokens=0 with echo returns the prompt only;
vLLM's prompt_logprobs on both routes; logit_bias forces and bans tokens; presence, frequency and
repetition penalties and min_tokens follow vLLM's definitions (a naive loop over full forwards);
OpenAI fields that change nothing are accepted, the others refused by name."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from meshtron.inference.server import build_app
from tests.inference.helpers import TOKENIZER, engine, tiny_model
from tests.inference.test_server_app import error_of, wait_for

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

PROMPT = "The cat sat"
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model("gqa-rope")


@pytest.fixture(scope="module")
def client(model):
    with TestClient(build_app(lambda: engine(model, num_blocks=128, block_size=4))) as c:
        wait_for(c, 200)
        yield c


@torch.no_grad()
def log_probs_of(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab): row p is log p(. | ids[:p + 1]), the full forward's."""
    return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def generated_ids(choice: dict, skip: int = 0) -> list[int]:
    """Token ids of a choice asked with logprobs and return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"][skip:]]


def check_prompt_part(model, logprobs: dict, ids: list[int], k: int) -> None:
    """The echoed prompt's entries against the full forward: null first, then each token's log prob,
    its top k (and the prompt token itself), offsets at each token's first character."""
    reference = log_probs_of(model, ids)
    assert logprobs["tokens"][:len(ids)] == [TOKENIZER.decode([i]) for i in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][:len(ids)] == [len(TOKENIZER.decode(ids[:p])) for p in range(len(ids))]
    for p in range(1, len(ids)):
        assert logprobs["token_logprobs"][p] == pytest.approx(float(reference[p - 1, ids[p]]), abs=ATOL)
        top = logprobs["top_logprobs"][p]
        expected = {TOKENIZER.decode([i]) for i in reference[p - 1].topk(k).indices.tolist()}
        assert expected | {TOKENIZER.decode([ids[p]])} == set(top)


def test_echo_logprobs_cover_the_prompt_then_the_completion(client, model):
    ids = TOKENIZER.encode(PROMPT)
    plain = complete(client, prompt=PROMPT, max_tokens=4, logprobs=2)["choices"][0]
    echoed = complete(client, prompt=PROMPT, max_tokens=4, logprobs=2, echo=True)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    logprobs = echoed["logprobs"]
    check_prompt_part(model, logprobs, ids, 2)
    for key in ("tokens", "token_logprobs", "top_logprobs"):  # then exactly the completion's entries
        assert logprobs[key][len(ids):] == plain["logprobs"][key]
    offsets = logprobs["text_offset"][len(ids):]
    assert offsets == [o + len(PROMPT) for o in plain["logprobs"]["text_offset"]]
    assert offsets[0] == len(PROMPT)
    # the completion's own top_logprobs: the 2 most likely and the chosen token (OpenAI: up to k + 1)
    assert all(1 <= len(top) <= 3 for top in plain["logprobs"]["top_logprobs"])


def test_echo_of_max_tokens_zero_is_the_prompt_scored(client, model):
    prompts = [TOKENIZER.encode("abc d"), TOKENIZER.encode("x = 1")]
    body = complete(client, prompt=prompts, max_tokens=0, echo=True, logprobs=1, n=2)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice, ids in zip(body["choices"], [prompts[0]] * 2 + [prompts[1]] * 2):
        assert choice["text"] == TOKENIZER.decode(ids) and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        check_prompt_part(model, choice["logprobs"], ids, 1)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    bare = complete(client, prompt=PROMPT, max_tokens=0, echo=True)["choices"][0]  # no logprobs asked
    assert bare["text"] == PROMPT and bare["logprobs"] is None


def stream_choices(client, body: dict) -> tuple[dict[int, dict], dict[int, int]]:
    """A stream merged per choice: text and logprobs lists concatenated; and how many tokens each
    choice's first chunk carried."""
    merged: dict[int, dict] = {}
    first: dict[int, int] = {}
    with client.stream("POST", "/v1/completions", json={"temperature": 0, "ignore_eos": True, **body,
                                                        "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[6:])["choices"]
            i = choice["index"]
            if i not in merged:
                first[i] = len(choice["logprobs"]["tokens"])
                merged[i] = {"text": "", "logprobs": {k: [] for k in choice["logprobs"]}}
            merged[i]["text"] += choice["text"]
            for key, values in (choice["logprobs"] or {}).items():
                merged[i]["logprobs"][key] += values
    return merged, first


def test_a_streamed_echo_equals_the_whole_answer(client):
    body = {"prompt": ["ab", "hello"], "n": 2, "max_tokens": 3, "echo": True, "logprobs": 1}
    whole = complete(client, **body)["choices"]
    merged, first = stream_choices(client, body)
    assert sorted(merged) == [0, 1, 2, 3]
    for i, choice in enumerate(whole):
        assert merged[i]["text"] == choice["text"] and merged[i]["logprobs"] == choice["logprobs"]
        assert first[i] >= len(TOKENIZER.encode(["ab", "hello"][i // 2]))  # the prompt part comes first, whole


def test_prompt_logprobs_in_vllm_shape_on_both_routes(client, model):
    ids = TOKENIZER.encode(PROMPT)
    reference = log_probs_of(model, ids)
    choice = complete(client, prompt=PROMPT, max_tokens=0, prompt_logprobs=2)["choices"][0]
    assert choice["text"] == "" and choice["logprobs"] is None
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for p in range(1, len(ids)):
        entry = scored[p]
        assert next(iter(entry)) == str(ids[p])  # the prompt token first
        assert entry[str(ids[p])]["logprob"] == pytest.approx(float(reference[p - 1, ids[p]]), abs=ATOL)
        values, top = reference[p - 1].topk(2)
        for rank, (token, value) in enumerate(zip(top.tolist(), values.tolist()), 1):
            assert entry[str(token)] == {"logprob": pytest.approx(value, abs=ATOL), "rank": rank,
                                         "decoded_token": TOKENIZER.decode([token])}
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2, "prompt_logprobs": 0, "temperature": 0})
    assert chat.status_code == 200, chat.text
    templated = chat.json()["prompt_logprobs"]
    assert templated[0] is None and chat.json()["usage"]["prompt_tokens"] == len(templated)
    assert all(len(entry) == 1 for entry in templated[1:])


def test_logit_bias_forces_and_bans(client, model):
    ids = TOKENIZER.encode(PROMPT)
    forced = complete(client, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3, logprobs=0,
                      return_tokens_as_token_ids=True, logit_bias={str(ord("z")): 100})["choices"][0]
    assert forced["text"] == "zzzzz" and generated_ids(forced) == [ord("z")] * 5
    first = int(log_probs_of(model, ids)[-1].argmax())
    banned = complete(client, prompt=PROMPT, max_tokens=1, logprobs=0, return_tokens_as_token_ids=True,
                      logit_bias={str(first): -100})["choices"][0]
    runner_up = int(log_probs_of(model, ids)[-1].topk(2).indices[1])
    assert generated_ids(banned) == [runner_up] != [first]


@torch.no_grad()
def processed_logits(model, prompt: list[int], out: list[int], presence=0.0, frequency=0.0, repetition=1.0,
                     min_tokens=0, stop_ids=()) -> torch.Tensor:
    """vLLM's definitions on the full forward's last logits: repetition divides a positive logit (and
    multiplies a negative one) of every token in the prompt or the output; frequency subtracts per
    occurrence in the output, presence once; stop ids are masked until min_tokens were generated."""
    logits = model(torch.tensor([prompt + out]))[0, -1].float().clone()
    for token in set(prompt) | set(out):
        logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
    for token, count in Counter(out).items():
        logits[token] -= frequency * count + presence
    if len(out) < min_tokens:
        logits[list(stop_ids)] = float("-inf")
    return logits


def naive_greedy(model, prompt: list[int], max_tokens: int, stop_ids=(), **processors) -> list[int]:
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(int(processed_logits(model, prompt, out, stop_ids=stop_ids, **processors).argmax()))
        if out[-1] in stop_ids:
            break
    return out


PENALTIES = [{"presence_penalty": 1.0}, {"frequency_penalty": 0.8}, {"repetition_penalty": 1.5},
             {"presence_penalty": -0.5, "frequency_penalty": 0.7, "repetition_penalty": 0.8}]


def naive_names(penalties: dict) -> dict:
    return {"presence": penalties.get("presence_penalty", 0.0), "frequency": penalties.get("frequency_penalty", 0.0),
            "repetition": penalties.get("repetition_penalty", 1.0)}


@pytest.mark.parametrize("penalties", PENALTIES)
def test_penalties_follow_vllm_definitions(client, model, penalties):
    """Greedy tokens equal the naive loop's (and differ from no penalty); sampled with logprobs_mode
    'processed', every step's log probs are the log-softmax of the naive penalised logits."""
    ids = TOKENIZER.encode("aaaa aaaa")
    greedy = complete(client, prompt=ids, max_tokens=16, logprobs=0, return_tokens_as_token_ids=True, **penalties)
    expected = naive_greedy(model, ids, 16, **naive_names(penalties))
    assert generated_ids(greedy["choices"][0]) == expected != naive_greedy(model, ids, 16)
    sampled = complete(client, prompt=ids, max_tokens=12, temperature=1.0, seed=5, logprobs=5,
                       logprobs_mode="processed", return_tokens_as_token_ids=True, **penalties)["choices"][0]
    out = generated_ids(sampled)
    for j, token in enumerate(out):
        reference = processed_logits(model, ids, out[:j], **naive_names(penalties)).log_softmax(-1)
        assert sampled["logprobs"]["token_logprobs"][j] == pytest.approx(float(reference[token]), abs=ATOL)
        values, top = reference.topk(5)
        got = sampled["logprobs"]["top_logprobs"][j]
        for token_id, value in zip(top.tolist(), values.tolist()):
            assert got[f"token_id:{token_id}"] == pytest.approx(value, abs=ATOL)


def test_min_tokens_masks_the_stop_tokens(client, model):
    ids = TOKENIZER.encode(PROMPT)
    stop = naive_greedy(model, ids, 1)[0]  # what greedy picks first: a stop token from the start
    body = {"prompt": ids, "max_tokens": 8, "logprobs": 0, "return_tokens_as_token_ids": True,
            "stop_token_ids": [stop], "ignore_eos": False}
    assert generated_ids(complete(client, **body)["choices"][0]) == [stop]
    held = complete(client, **body, min_tokens=3)["choices"][0]
    assert generated_ids(held) == naive_greedy(model, ids, 8, stop_ids=(stop, TOKENIZER.eod_id), min_tokens=3)
    assert len(generated_ids(held)) >= 3


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_fields_that_change_nothing_are_accepted_and_the_rest_refused_by_name(client, route):
    base = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    base = {**base, "max_tokens": 4, "temperature": 0}
    plain = client.post(route, json=base)
    harmless = {"user": "u-1", "store": True, "metadata": {"k": "v"}, "service_tier": "auto",
                "parallel_tool_calls": False}
    accepted = client.post(route, json={**base, **harmless})
    assert plain.status_code == accepted.status_code == 200
    assert accepted.json()["choices"] == plain.json()["choices"]
    for name, value in [("tools", []), ("best_of", 2), ("suffix", "x"), ("response_format", {"type": "json_object"}),
                        ("logit_bias_typo", {})]:
        error = error_of(client.post(route, json={**base, name: value}), 400)
        assert error["param"] == name and error["message"] == f"{name}: is not a supported parameter"
