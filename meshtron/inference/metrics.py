"""The server's Prometheus metrics (`GET /metrics`, text format, written by `prometheus_client`).

Each app owns a `CollectorRegistry`, so several servers in one process never share counters. Token
counters count what `usage` reports (a prompt once per prompt, however large n is); the
prefix-cache counters count prompt tokens per engine request (queried) and those found in the
cache (hit), so hit rate = hits / queries. Queue and KV-block gauges are read from the engine when
scraped. Latencies come from each finished request's arrival, first-token and finish times.
Speculative decoding (engine.speculative_method): drafts verified and accepted are counted per
finished request (acceptance rate = accepted / draft tokens), and each request's acceptance rate and
output tokens per model forward (the speed-up over one token per forward) are histograms.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from meshtron.inference.outputs import RequestOutput

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0)
ACCEPTANCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TOKENS_PER_STEP_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("meshtron_requests_running", "Engine requests running (in the batch)", registry=r)
        self.waiting = Gauge("meshtron_requests_waiting", "Engine requests waiting for a slot", registry=r)
        self.blocks_used = Gauge("meshtron_kv_blocks_used", "KV-cache blocks held by requests", registry=r)
        self.blocks_total = Gauge("meshtron_kv_blocks_total", "KV-cache blocks in all", registry=r)
        self.prompt_tokens = Counter("meshtron_prompt_tokens", "Prompt tokens, as usage.prompt_tokens counts them",
                                     registry=r)
        self.generation_tokens = Counter("meshtron_generation_tokens", "Generated tokens (usage.completion_tokens)",
                                         registry=r)
        self.prefix_queries = Counter("meshtron_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("meshtron_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.finished = Counter("meshtron_requests_finished", "Engine requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter("meshtron_errors", "Error answers (HTTP status and OpenAI error type)",
                              ["status", "type"], registry=r)
        self.ttft = Histogram("meshtron_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("meshtron_time_per_output_token_seconds",
                              "Mean time between output tokens, one observation per request", buckets=TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("meshtron_e2e_request_latency_seconds", "Arrival to finish", buckets=E2E_BUCKETS,
                             registry=r)
        self.spec_draft_tokens = Counter("meshtron_spec_draft_tokens", "Speculative decoding: drafted tokens the "
                                         "model verified", registry=r)
        self.spec_accepted_tokens = Counter("meshtron_spec_accepted_tokens", "Speculative decoding: drafted tokens "
                                            "accepted", registry=r)
        self.spec_acceptance = Histogram("meshtron_spec_acceptance_rate", "Speculative decoding: accepted / drafted "
                                         "tokens, one observation per request", buckets=ACCEPTANCE_BUCKETS, registry=r)
        self.spec_tokens_per_step = Histogram("meshtron_spec_tokens_per_step", "Speculative decoding: output tokens "
                                              "per model forward, one observation per request",
                                              buckets=TOKENS_PER_STEP_BUCKETS, registry=r)

    def finished_request(self, out: RequestOutput, count_prompt: bool) -> None:
        """One engine request ended; `count_prompt` for the first choice of its prompt."""
        self.finished.labels(out.finish_reason or "unknown").inc()
        if count_prompt:
            self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(len(out.token_ids))
        if out.num_draft_tokens:
            self.spec_draft_tokens.inc(out.num_draft_tokens)
            self.spec_accepted_tokens.inc(out.num_accepted_tokens)
            self.spec_acceptance.observe(out.acceptance_rate)
            self.spec_tokens_per_step.observe(out.tokens_per_step)
        if out.first_token_time is None:  # never scheduled: no cache lookup, no latency
            return
        self.prefix_queries.inc(out.num_prompt_tokens)
        self.prefix_hits.inc(out.num_cached_tokens)
        self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
        if out.finish_time is not None:
            self.e2e.observe(max(0.0, out.finish_time - out.arrival_time))
            if len(out.token_ids) > 1:
                self.tpot.observe(max(0.0, out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))

    def error(self, status: int, kind: str) -> None:
        self.errors.labels(str(status), kind).inc()

    def render(self, stats: Optional[dict]) -> bytes:
        """The text exposition; `stats` is `engine.stats()` (None before the engine is up)."""
        if stats is not None:
            self.running.set(stats["num_running"])
            self.waiting.set(stats["num_waiting"])
            self.blocks_total.set(stats["num_blocks"])
            self.blocks_used.set(stats["num_blocks"] - stats["num_free_blocks"])
        return generate_latest(self.registry)
