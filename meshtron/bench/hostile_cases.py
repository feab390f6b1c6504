"""The hostile client of `meshtron bench hostile`: the requests of issue 16 that once hurt the server
(huge seeds, tiny or non-finite temperatures, a shared X-Request-Id, 4 MB prompts, 16,000 choices,
100k stop strings, lone surrogates, malformed bodies, clients that go away), each sent over HTTP and
classified by what came back. A case lists the outcomes it accepts; anything else (a 5xx, a timeout,
a 4xx whose body is not OpenAI's error shape, a wrong text) is a failure the benchmark reports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
JSON_HEADERS = {"content-type": "application/json"}
# The two prompts of the shared X-Request-Id case; their texts alone are computed before the phases.
SAME_ID_PROMPTS = ("hostile twin one", "hostile twin two")
CONTROL = "control: 1-token completion"


@dataclass
class HostileContext:
    """What the cases share: the HTTP client, a timeout per request and the greedy texts alone."""

    client: Any  # httpx.AsyncClient with the server's base_url
    timeout_s: float
    expected: dict[str, str]  # prompt -> greedy text when it is answered alone
    max_tokens: int  # of the shared-id pair (as the good clients')
    long_tokens: int  # of the requests a client walks away from: long enough to be in flight


@dataclass
class Case:
    name: str
    send: Callable[[HostileContext], Awaitable[list[str]]]  # -> one outcome per HTTP request made
    accept: frozenset[str]  # outcome classes that are fine: "4xx", "2xx", "abandoned"
    note: str = ""


@dataclass
class CaseRecord:
    """The outcomes of one case over a run: counts per outcome and how many were failures."""

    accept: list[str]
    outcomes: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    max_s: float = 0.0  # the longest a sending of the case took (all its requests)

    def merge(self, other: dict[str, Any]) -> None:
        """Add the counts of another record (as dataclasses.asdict gives them)."""
        for outcome, count in other["outcomes"].items():
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + count
        self.failures += other["failures"]
        self.max_s = max(self.max_s, other["max_s"])

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome_class(outcome) not in self.accept:
            self.failures += 1


def outcome_class(outcome: str) -> str:
    """'400' -> '4xx', '200' -> '2xx'; 'timeout', 'connection_error', '4xx-unshaped', '200-wrong-text'
    and 'abandoned' are their own classes."""
    if outcome.isdigit():
        return outcome[0] + "xx"
    return outcome


def status_outcome(response) -> str:
    """The outcome of a complete response: its status, or '<status>-unshaped' for a 4xx/5xx whose body
    is not {"error": {"message": ...}} as OpenAI's clients expect."""
    code = response.status_code
    if code >= 400:
        try:
            error = response.json().get("error")
            shaped = isinstance(error, dict) and isinstance(error.get("message"), str)
        except (ValueError, AttributeError):
            shaped = False
        if not shaped:
            return f"{code // 100}xx-unshaped"
    return str(code)


async def post(ctx: HostileContext, path: str, body: Any = None, raw: bytes | None = None,
               headers: dict[str, str] | None = None) -> Any:
    """One POST; -> the response, or the outcome string of a transport failure."""
    import httpx

    content = raw if raw is not None else json.dumps(body).encode()
    try:
        return await ctx.client.post(path, content=content, headers={**JSON_HEADERS, **(headers or {})},
                                     timeout=ctx.timeout_s)
    except httpx.TimeoutException:
        return "timeout"
    except httpx.TransportError:
        return "connection_error"


async def one(ctx: HostileContext, path: str, body: Any = None, raw: bytes | None = None) -> list[str]:
    response = await post(ctx, path, body, raw)
    return [response if isinstance(response, str) else status_outcome(response)]


def json_case(name: str, body: Any, path: str = COMPLETIONS, note: str = "") -> Case:
    raw = json.dumps(body).encode()  # built once: the client's own cost stays out of the phases
    return Case(name, lambda ctx: one(ctx, path, raw=raw), frozenset({"4xx"}), note)


def raw_case(name: str, raw: bytes, note: str = "") -> Case:
    return Case(name, lambda ctx: one(ctx, COMPLETIONS, raw=raw), frozenset({"4xx"}), note)


def greedy_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


async def same_request_id(ctx: HostileContext) -> list[str]:
    """Two requests at once with one X-Request-Id: each must get its own prompt's greedy text."""
    async def ask(prompt: str) -> str:
        response = await post(ctx, COMPLETIONS, greedy_body(prompt, ctx.max_tokens),
                              headers={"x-request-id": "hostile-same-id"})
        if isinstance(response, str):
            return response
        outcome = status_outcome(response)
        if response.status_code == 200 and response.json()["choices"][0]["text"] != ctx.expected[prompt]:
            return "200-wrong-text"
        return outcome

    return list(await asyncio.gather(*(ask(p) for p in SAME_ID_PROMPTS)))


async def disconnect_mid_stream(ctx: HostileContext) -> list[str]:
    """Open a long stream, read its first event and hang up (the server must abort and free it)."""
    import httpx

    body = json.dumps(greedy_body("hang up on me", ctx.long_tokens, stream=True)).encode()
    try:
        async with ctx.client.stream("POST", COMPLETIONS, content=body, headers=JSON_HEADERS,
                                     timeout=ctx.timeout_s) as response:
            if response.status_code != 200:
                await response.aread()
                return [status_outcome(response)]
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break
        return ["200"]
    except httpx.TimeoutException:
        return ["timeout"]
    except httpx.TransportError:
        return ["connection_error"]


async def abandon_before_reply(ctx: HostileContext) -> list[str]:
    """A client that gives up 50 ms into a long request (a timeout on its side)."""
    import httpx

    body = json.dumps(greedy_body("nobody waits for me", ctx.long_tokens)).encode()
    try:
        response = await ctx.client.post(COMPLETIONS, content=body, headers=JSON_HEADERS, timeout=0.05)
    except httpx.TimeoutException:
        return ["abandoned"]
    except httpx.TransportError:
        return ["connection_error"]
    return [status_outcome(response)]


def build_cases(max_model_len: int) -> list[Case]:
    """Every case, in the order the hostile client loops over them."""
    small = {"prompt": "x", "max_tokens": 4}
    user = [{"role": "user", "content": "hi"}]
    cases = [
        json_case("seed 2**64", {**small, "seed": 2**64}, note="once killed the engine loop for good"),
        json_case("seed 2**64-1, n=2", {**small, "seed": 2**64 - 1, "n": 2}, note="the index is added to the seed"),
        json_case("temperature 1e-300", {**small, "temperature": 1e-300}, note="once a 500 for the whole step"),
        raw_case("temperature Infinity", b'{"prompt": "x", "max_tokens": 4, "temperature": Infinity}'),
        raw_case("temperature NaN", b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}'),
        Case("same X-Request-Id x2", same_request_id, frozenset({"2xx"}), "each must get its own text"),
        json_case("4 MB prompt", {"prompt": "a" * (4 * 2**20), "max_tokens": 4}, note="once blocked others 10 s"),
        json_case("1,000 prompts x n=16", {"prompt": ["hi"] * 1000, "n": 16, "max_tokens": 4},
                  note="once 16,000 engine requests"),
        json_case("100k stop strings", {**small, "stop": [f"s{i}" for i in range(100_000)]}),
        json_case("100k stop_token_ids", {**small, "stop_token_ids": list(range(100_000))}),
        raw_case("lone surrogate", b'{"prompt": "a\\ud800b", "max_tokens": 4}', note="once a 500"),
        json_case("float token ids", {"prompt": [1.0, 2.5], "max_tokens": 4}),
        json_case("bool token ids", {"prompt": [True, False], "max_tokens": 4}),
        json_case("token id out of range", {"prompt": [10**9], "max_tokens": 4}),
        json_case("negative token id", {"prompt": [-1], "max_tokens": 4}),
        json_case("unknown model", {**small, "model": "gpt-4-not-here"}, note="404 as OpenAI"),
        json_case("image part in chat", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, CHAT),
        json_case("top_logprobs without logprobs", {"messages": user, "top_logprobs": 5}, CHAT),
        json_case("max_tokens past the context", {**small, "max_tokens": max_model_len * 1000}),
        json_case("n=0", {**small, "n": 0}),
        raw_case("invalid JSON", b'{"prompt": "x", "max_tokens": '),
        raw_case("non-UTF-8 body", b'{"prompt": "\xff\xfe", "max_tokens": 4}'),
        raw_case("a JSON array body", b'[1, 2, 3]'),
        raw_case("5,000-digit seed", b'{"prompt": "x", "max_tokens": 4, "seed": ' + b"9" * 5000 + b"}"),
        raw_case("nested 100k deep", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        raw_case("9 MB body", b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}', note="over --max-body-bytes: 413"),
        Case("disconnect mid-stream", disconnect_mid_stream, frozenset({"2xx"}), "the server must free its blocks"),
        Case("abandon before the reply", abandon_before_reply, frozenset({"abandoned", "2xx"})),
    ]
    assert len({c.name for c in cases}) == len(cases)
    return cases


def control_case() -> Case:
    """The client of phase C: well-behaved, but as busy as the hostile one (back to back, no pause), so
    B/C separates what the hostile requests cost from what any ninth busy client costs."""
    raw = json.dumps({"prompt": "x", "max_tokens": 1, "temperature": 0}).encode()
    return Case(CONTROL, lambda ctx: one(ctx, COMPLETIONS, raw=raw), frozenset({"2xx"}),
                "a valid request, sent as fast as the server answers")


async def hostile_loop(ctx: HostileContext, cases: list[Case], records: dict[str, CaseRecord],
                       stopped: Callable[[], bool], min_rounds: int) -> int:
    """Send the cases in order, round after round, until `stopped()` and `min_rounds` full rounds are
    done; -> HTTP requests made. One case at a time: this is one client."""
    num_requests, rounds = 0, 0
    while not (rounds >= min_rounds and stopped()):
        for case in cases:
            if rounds >= min_rounds and stopped():
                break
            start = time.perf_counter()
            outcomes = await case.send(ctx)
            record = records[case.name]
            record.max_s = max(record.max_s, time.perf_counter() - start)
            for outcome in outcomes:
                record.add(outcome)
            num_requests += len(outcomes)
        else:
            rounds += 1
    return num_requests


def hostile_process(spec: dict[str, Any], stop, results) -> None:
    """The hostile (or control) client in a process of its own (spawned), so its client-side work never
    shares the good clients' event loop. Puts ("ready",) once its cases are built, then loops until `stop` (a
    multiprocessing Event) is set and puts ("done", {case: CaseRecord fields}, requests made)."""
    asyncio.run(_hostile_main(spec, stop, results))


async def _hostile_main(spec: dict[str, Any], stop, results) -> None:
    import httpx

    cases = [c for c in [*build_cases(spec["max_model_len"]), control_case()] if c.name in spec["names"]]
    records = {c.name: CaseRecord(sorted(c.accept)) for c in cases}
    async with httpx.AsyncClient(base_url=spec["url"]) as client:
        ctx = HostileContext(client, spec["timeout_s"], spec["expected"], spec["max_tokens"], spec["long_tokens"])
        results.put(("ready",))
        num_requests = await hostile_loop(ctx, cases, records, stop.is_set, spec["min_rounds"])
    results.put(("done", {name: dataclasses.asdict(r) for name, r in records.items()}, num_requests))
