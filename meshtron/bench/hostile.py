"""Load with a hostile client: do well-behaved clients notice one that sends what broke the server?

One `meshtron serve` process (a tiny random model, CPU) on 127.0.0.1. Phase A: N clients each send K
greedy completions in a closed loop (fixed prompts, fixed max_tokens); phase B: the same, plus one
hostile client (its own process) looping over the cases of hostile_cases.py; phase C (the control):
the same N plus one well-behaved client as busy as the hostile one. Phases alternate (A B C, --pairs
times) so a slow spell of a shared machine hits all; per phase the good clients' completed and
correct counts (text equal to the prompt answered alone) and p50/p99 latency; B/A, C/A and B/C
ratios, medians over pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from meshtron.bench.hostile_cases import CONTROL, SAME_ID_PROMPTS, Case, CaseRecord, build_cases, control_case
from meshtron.bench.hostile_procs import (
    HostileClient,
    Server,
    git_state,
    log_summary,
    save_checkpoint,
    server_after_phase,
    server_cpu_s,
)

DEFAULT_OUTPUT = Path("benchmarks/results/hostile.json")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="benchmarks/hostile_load.py", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8, help="well-behaved clients (each one request at a time)")
    p.add_argument("--requests", type=int, default=40, help="requests of each good client per phase")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens of each good request (greedy, eos ignored)")
    p.add_argument("--pairs", type=int, default=5, help="rounds of the phases (A, B, C); ratios are medians over them")
    p.add_argument("--min-hostile-rounds", type=int, default=1,
                   help="phase B lasts until the hostile client has sent every case this many times")
    p.add_argument("--cases", nargs="+", default=None, metavar="WORD",
                   help="only the hostile cases whose name contains one of these words (case-insensitive), "
                        "e.g. --cases seed temperature 'MB'; default: every case")
    p.add_argument("--no-control", action="store_true",
                   help="skip phase C (the good clients plus a well-behaved client as busy as the hostile one)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds a good request may take")
    p.add_argument("--hostile-timeout", type=float, default=60.0, help="seconds a hostile request may take")
    p.add_argument("--max-phase-s", type=float, default=600.0, help="good clients send nothing new after this")
    p.add_argument("--url", default=None, help="measure a server already running on this machine "
                   "(http://127.0.0.1:PORT) instead of starting one; the model flags below are then unused")
    p.add_argument("--server-args", default="", metavar="FLAGS",
                   help="more flags for the `meshtron serve` started here, e.g. --server-args='--max-body-bytes "
                        "1048576' (request limits, engine options)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--max-len", type=int, default=256, help="the model's context length (max_model_len)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (1: steady on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(DEFAULT_OUTPUT))
    return p


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name in ("clients", "requests", "max_tokens", "pairs", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: {getattr(args, name)} must be >= 1")
    if args.min_hostile_rounds < 0:
        raise SystemExit(f"--min-hostile-rounds: {args.min_hostile_rounds} must be >= 0")
    for name in ("request_timeout", "hostile_timeout", "max_phase_s"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')}: {getattr(args, name)} must be > 0")
    if args.url is None and args.max_len < 64 + args.max_tokens:
        raise SystemExit(f"--max-len: {args.max_len} is below the longest good prompt (64) + --max-tokens; raise it")
    if args.url is not None:
        args.url = loopback_url(args.url)
    return args


def loopback_url(url: str) -> str:
    """The hostile client sends abusive requests: only to a server on this machine."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK:
        raise SystemExit(f"--url: {url!r} is not a server on this machine; give http://127.0.0.1:PORT")
    return url.rstrip("/")


def good_prompts(num_clients: int) -> list[str]:
    """One fixed prompt per client, of different lengths (under 64 bytes: one token per byte)."""
    words = "the quick brown fox jumps over the lazy dog".split()
    return [f"client {i}: " + " ".join(words[: 1 + i % len(words)]) for i in range(num_clients)]


def good_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def expected_texts(url: str, prompts: list[str], max_tokens: int, timeout_s: float) -> dict[str, str]:
    """Each prompt answered alone (one request in the server at a time), greedy: the reference text."""
    import httpx

    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        for prompt in prompts:
            r = await client.post("/v1/completions", json=good_body(prompt, max_tokens))
            if r.status_code != 200:
                raise SystemExit(f"the reference request for {prompt!r} got {r.status_code}: {r.text[:500]}")
            out[prompt] = r.json()["choices"][0]["text"]
    return out


async def good_client(client, prompt: str, expected: str, args, deadline: float) -> list[dict[str, Any]]:
    """K requests one after another; each: latency, outcome, whether the text was the reference."""
    import httpx

    records = []
    for _ in range(args.requests):
        if time.monotonic() > deadline:
            break
        start = time.perf_counter()
        try:
            r = await client.post("/v1/completions", json=good_body(prompt, args.max_tokens),
                                  timeout=args.request_timeout)
            outcome = str(r.status_code)
            correct = r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        except httpx.TimeoutException:
            outcome, correct = "timeout", False
        except httpx.TransportError:
            outcome, correct = "connection_error", False
        records.append({"latency_s": time.perf_counter() - start, "outcome": outcome, "correct": correct})
    return records


@dataclass
class Workload:
    prompts: list[str]  # one per good client
    expected: dict[str, str]  # prompt -> its greedy text answered alone
    cases: list[Case]
    records: dict[str, CaseRecord]  # case name -> outcomes over every B phase (and the control's over C)
    long_tokens: int  # max_tokens of the requests the hostile client walks away from
    max_model_len: int

    @classmethod
    def build(cls, prompts: list[str], expected: dict[str, str], max_model_len: int,
              words: Optional[list[str]] = None) -> Workload:
        cases = select_cases(build_cases(max_model_len), words)
        records = {c.name: CaseRecord(sorted(c.accept)) for c in [*cases, control_case()]}
        return cls(prompts, expected, cases, records,
                   max(1, min(200, max_model_len - 32)), max_model_len)


def select_cases(cases: list[Case], words: Optional[list[str]]) -> list[Case]:
    if not words:
        return cases
    chosen = [c for c in cases if any(w.lower() in c.name.lower() for w in words)]
    if not chosen:
        raise SystemExit(f"--cases: {' '.join(words)} matches no case; the cases are: "
                         + "; ".join(c.name for c in cases))
    return chosen


def extra_client_spec(url: str, work: Workload, args, kind: str) -> dict[str, Any]:
    """What the ninth client of phase B (hostile) or C (control) sends."""
    names = [c.name for c in work.cases] if kind == "B" else [CONTROL]
    return {"url": url, "names": names, "max_model_len": work.max_model_len,
            "timeout_s": args.hostile_timeout, "expected": work.expected, "max_tokens": args.max_tokens,
            "long_tokens": work.long_tokens, "min_rounds": args.min_hostile_rounds}


async def run_phase(url: str, server: Optional[Server], work: Workload, args, kind: str) -> dict[str, Any]:
    """One phase: every good client's K requests, with the hostile client looping alongside in B and the
    control client in C."""
    import httpx

    prompts, expected = work.prompts, work.expected
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    bad = HostileClient(extra_client_spec(url, work, args, kind)) if kind != "A" else None
    if bad is not None:
        await asyncio.to_thread(bad.wait_ready)
    async with httpx.AsyncClient(base_url=url, limits=limits) as good:
        deadline = time.monotonic() + args.max_phase_s
        start, cpu, server_cpu = time.perf_counter(), time.process_time(), server_cpu_s(server)
        per_client = await asyncio.gather(*(good_client(good, p, expected[p], args, deadline) for p in prompts))
        good_wall = time.perf_counter() - start
        cpu, server_cpu = time.process_time() - cpu, delta(server_cpu_s(server), server_cpu)
    num_extra = await asyncio.to_thread(bad.finish, work.records) if bad is not None else 0
    phase = summarize_phase([r for client in per_client for r in client], good_wall, args, num_extra)
    phase.update(client_cpu_s=cpu, server_cpu_s=server_cpu)
    return phase


def delta(after: Optional[float], before: Optional[float]) -> Optional[float]:
    return after - before if after is not None and before is not None else None


def percentile_ms(values: list[float], q: float) -> Optional[float]:
    """Nearest-rank percentile in ms; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * 1e3


def summarize_phase(records: list[dict[str, Any]], wall: float, args, num_extra: int) -> dict[str, Any]:
    completed = [r for r in records if r["outcome"] == "200"]
    latencies = [r["latency_s"] for r in completed]
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    return {"requests": args.clients * args.requests, "sent": len(records), "completed": len(completed),
            "correct": sum(r["correct"] for r in records), "outcomes": outcomes, "wall_s": wall,
            "completed_per_s": len(completed) / wall, "p50_ms": percentile_ms(latencies, 0.5),
            "p99_ms": percentile_ms(latencies, 0.99), "mean_ms": statistics.fmean(latencies) * 1e3 if latencies else None,
            "extra_client_requests": num_extra}


def ratio(b: Optional[float], a: Optional[float]) -> Optional[float]:
    return b / a if a and b is not None else None


def pair_ratios(phases: list[dict[str, Any]], num: str, den: str) -> dict[str, Any]:
    """num/den (e.g. B/A) per pair of p50, p99 and completed requests/s, and their medians over the pairs."""
    by_pair: dict[int, dict[str, dict]] = {}
    for p in phases:
        by_pair.setdefault(p["pair"], {})[p["phase"]] = p
    out: dict[str, Any] = {}
    for key in ("p50_ms", "p99_ms", "completed_per_s"):
        per_pair = [ratio(pp[num][key], pp[den][key]) for pp in by_pair.values() if num in pp and den in pp]
        values = [r for r in per_pair if r is not None]
        out[key] = {"per_pair": per_pair, "median": statistics.median(values) if values else None,
                    "min": min(values, default=None), "max": max(values, default=None)}
    return out


def totals(phases: list[dict[str, Any]], name: str) -> dict[str, int]:
    chosen = [p for p in phases if p["phase"] == name]
    return {k: sum(p[k] for p in chosen) for k in ("requests", "sent", "completed", "correct")}


async def run_pairs(url: str, server: Optional[Server], work: Workload, args) -> list[dict[str, Any]]:
    """A, B, C (or A, B), --pairs times; stops early if the server dies (the phases so far are kept)."""
    phases = []
    for pair in range(args.pairs):
        for name in phase_names(args):
            phase = await run_phase(url, server, work, args, name)
            phase.update(pair=pair, phase=name, server=await server_after_phase(url, server))
            phases.append(phase)
            print(phase_row(phase), flush=True)
            if not phase["server"]["alive"]:
                return phases
    return phases


def phase_names(args) -> tuple[str, ...]:
    return ("A", "B") if args.no_control else ("A", "B", "C")


def fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


HEADER = (f"{'pair':>4} {'phase':>5} {'sent':>5} {'done':>5} {'right':>5} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'req/s':>7} {'9th req':>7} {'srv cpu':>7} {'health':>6} {'leaked':>6} {'RSS MiB':>8}")


def phase_row(p: dict[str, Any]) -> str:
    s = p["server"]
    return (f"{p['pair']:>4} {p['phase']:>5} {p['sent']:>5} {p['completed']:>5} {p['correct']:>5} "
            f"{fmt(p['p50_ms'], '.0f'):>8} {fmt(p['p99_ms'], '.0f'):>8} {p['completed_per_s']:>7.1f} "
            f"{p['extra_client_requests']:>7} {fmt(p['server_cpu_s'], '.1f'):>7} {s.get('health', 'dead')!s:>6} {s.get('leaked_blocks', 'n/a')!s:>6} "
            f"{fmt(s.get('rss_mib'), '.0f'):>8}")


def print_report(result: dict[str, Any]) -> None:
    print("hostile cases (accepted outcomes, longest seconds of one sending, outcomes seen over every B phase):")
    for name, rec in result["hostile_cases"].items():
        seen = ", ".join(f"{k} x{v}" for k, v in sorted(rec["outcomes"].items()))
        flag = f"  FAILURES {rec['failures']}" if rec["failures"] else ""
        print(f"  {name:<32} {'/'.join(rec['accept']):<14} {rec['max_s']:>7.2f} {seen}{flag}")
    s = result["summary"]
    if result["control_case"] is not None:
        control = result["control_case"]
        print(f"control client (phase C): {control['outcomes']}, {control['failures']} failure(s)")
    for name, t in s["totals"].items():
        print(f"phase {name}, all pairs: {t['completed']}/{t['requests']} completed, {t['correct']} with the text "
              "answered alone")
    for name, r in s["ratios"].items():
        print(f"{name}, median over pairs: p50 {fmt(r['p50_ms']['median'], '.2f')}x, p99 "
              f"{fmt(r['p99_ms']['median'], '.2f')}x, completed/s {fmt(r['completed_per_s']['median'], '.2f')}x")
    print(f"hostile failures (5xx, timeouts, unshaped errors, wrong texts): {s['hostile_failures']}")
    if result["server_log"] is not None:
        log = result["server_log"]
        print(f"server log: {log['tracebacks']} traceback(s), {log['error_lines']} ERROR line(s); exit status after "
              f"SIGTERM: {result['server_exit_code']}")
    print(f"load average before/after: {result['load_average']['before']} / {result['load_average']['after']}")


def measure(url: str, args: argparse.Namespace, server: Optional[Server] = None) -> dict[str, Any]:
    """The reference texts, then the (A, B) pairs against the server at `url`; -> the JSON's body."""
    max_model_len = served_context(url)
    if max_model_len < 64 + args.max_tokens:
        raise SystemExit(f"--max-tokens: the server's context length {max_model_len} is below the longest good "
                         f"prompt (64) + {args.max_tokens}; lower --max-tokens")
    prompts = good_prompts(args.clients)
    expected = asyncio.run(expected_texts(url, [*prompts, *SAME_ID_PROMPTS], args.max_tokens, args.request_timeout))
    work = Workload.build(prompts, expected, max_model_len, args.cases)
    print(HEADER, flush=True)
    phases = asyncio.run(run_pairs(url, server, work, args))
    records = work.records
    hostile = {c.name: {"accept": records[c.name].accept, "outcomes": records[c.name].outcomes,
                        "failures": records[c.name].failures, "max_s": records[c.name].max_s, "note": c.note}
               for c in work.cases}
    names = phase_names(args)
    ratios = {"B/A": pair_ratios(phases, "B", "A")}
    if "C" in names:
        ratios.update({"C/A": pair_ratios(phases, "C", "A"), "B/C": pair_ratios(phases, "B", "C")})
    summary = {"totals": {name: totals(phases, name) for name in names}, "ratios": ratios,
               "hostile_failures": sum(records[c.name].failures for c in work.cases),
               "server_alive": all(p["server"]["alive"] for p in phases)}
    control = records[CONTROL]
    return {"max_model_len": max_model_len, "expected_texts": expected, "phases": phases, "hostile_cases": hostile,
            "control_case": None if args.no_control else {"outcomes": control.outcomes, "failures": control.failures},
            "summary": summary}


def served_context(url: str) -> int:
    import httpx

    r = httpx.get(url + "/v1/models", timeout=30)
    if r.status_code != 200:
        raise SystemExit(f"{url}/v1/models answered {r.status_code}: {r.text[:300]}")
    return int(r.json()["data"][0]["max_model_len"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Against --url, or a server of a tiny random model started (and stopped) here."""
    out: dict[str, Any] = {"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count(),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "git": git_state(),
                           "load_average": {"before": [round(x, 2) for x in os.getloadavg()]}}
    if args.url:
        out.update(measure(args.url, args), server_exit_code=None, server_log=None)
    else:
        with tempfile.TemporaryDirectory(prefix="meshtron-bench-hostile-") as tmp:
            save_checkpoint(Path(tmp) / "ckpt", args)
            server = Server(Path(tmp) / "ckpt", Path(tmp) / "server.log", args.threads,
                            tuple(shlex.split(args.server_args)))
            try:
                server.wait_ready()
                out.update(measure(server.url, args, server))
            finally:
                out["server_exit_code"] = server.stop()
            out["server_log"] = log_summary((Path(tmp) / "server.log").read_text(errors="replace"))
    out["load_average"]["after"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_report(result)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
