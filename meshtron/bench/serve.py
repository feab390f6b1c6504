"""Serving throughput and latency: meshtron's engine against static batching and a naive loop.

One seeded offline workload (every request arrives at t=0; prompt and output lengths drawn
uniformly) runs through
  (a) `LLMEngine` (continuous batching, paged KV cache, chunked prefill), by default as a user gets it
      (engine.decode_attention auto: the native decode-attention kernel on a CPU),
  (b) Hugging Face `transformers` `generate` with static batches on the same weights, converted with
      meshtron's own converter (left-padded batches; each batch runs until its longest request ends),
  (c) a naive loop: one request at a time with a contiguous KV cache.
Greedy decoding with eos ignored, so each request produces exactly its drawn number of tokens and
every system does the same useful work; output tokens/s counts only those tokens. Per request:
TTFT = first token time - arrival, TPOT = (finish - first token) / (tokens - 1); p50 and p99.
With --repeats N each system runs N times in the same process and the run of median wall time is
reported (the machine may be shared). On CUDA (--device cuda) it also measures decode tokens/s of
one request against the memory-bandwidth limit (every weight read once per token: bandwidth / weight
bytes), with and without CUDA graphs (--cuda-graphs); on a CPU those columns are n/a.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from meshtron.config.schema import ModelConfig
from meshtron.models import GPTModel
from meshtron.training.flops import resolve_bandwidth_gbps

DEFAULT_OUTPUT = Path("benchmarks/results/serve.json")
GOAL_RATIO = 3.0


@dataclass
class Timing:
    first_token: float  # seconds after the workload started
    finish: float
    num_tokens: int


def build_workload(num_requests: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                   vocab: int = 256) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        n = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (1,), generator=g))
        prompts.append(torch.randint(0, vocab, (n,), generator=g).tolist())
        outputs.append(int(torch.randint(output_range[0], output_range[1] + 1, (1,), generator=g)))
    return prompts, outputs


def build_model(args: argparse.Namespace) -> GPTModel:
    """A random Llama-shaped model (RMSNorm, SwiGLU, RoPE, untied), so the Llama converter applies."""
    torch.manual_seed(args.seed)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden_size, num_attention_heads=args.heads,
                      ffn_hidden_size=args.ffn, max_position_embeddings=args.max_len, make_vocab_size_divisible_by=1,
                      init_method_std=0.1)
    model = GPTModel(cfg, 262).eval()  # the byte tokenizer's vocabulary
    return model.to(device=args.device, dtype=getattr(torch, args.dtype))


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available; use --device cpu")
    return name


def graph_settings(args: argparse.Namespace) -> list[bool]:
    """CUDA graphs off/on for the engine runs; always off on a CPU (graphs are CUDA only)."""
    if args.device != "cuda":
        return [False]
    return {"on": [True], "off": [False], "both": [False, True]}[args.cuda_graphs]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def summarize(name: str, timings: list[Timing], wall: float) -> dict[str, Any]:
    ttft = [t.first_token for t in timings]
    tpot = [(t.finish - t.first_token) / (t.num_tokens - 1) for t in timings if t.num_tokens > 1]
    num_tokens = sum(t.num_tokens for t in timings)

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * 1e3

    return {"system": name, "num_requests": len(timings), "output_tokens": num_tokens, "wall_s": wall,
            "output_tokens_per_s": num_tokens / wall, "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "tpot_p50_ms": pct(tpot, 0.5), "tpot_p99_ms": pct(tpot, 0.99),
            "ttft_mean_ms": statistics.fmean(ttft) * 1e3}


# --decode-attention choices (engine.decode_attention) and their row names; auto is the default engine
DECODE_ATTENTION = ("auto", "gather", "compiled", "native", "flex")
DECODE_SUFFIX = {"auto": "", "gather": " gather", "compiled": " compiled", "native": " native", "flex": " flex"}


def build_engine(model: GPTModel, args, max_num_seqs: int, cuda_graphs: bool = False, attention: str = "auto"):
    """The engine with its default config but for the concurrency, step budget, device and decode attention."""
    from meshtron.data.tokenizer import ByteTokenizer
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine

    return LLMEngine(model, ByteTokenizer(), EngineConfig(
        device=args.device, max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        cuda_graphs=cuda_graphs, decode_attention=attention,
        cuda_graph_batch_sizes=tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= max(max_num_seqs, 1))))


def warm_up(model: GPTModel, prompts, args, attention: str) -> tuple[float, str]:
    """Build the decode attention before any timed run: the C kernel compiles once per machine; the
    torch.compile kernel once per process, with dynamic shapes, but sizes 0 and 1 are specialised (one
    decode and a one-block context get their own kernels, so the warm-up runs one short request alone,
    then several); -> (seconds, what the engine chose: gather, compiled or native)."""
    from meshtron.inference.request import SamplingParams

    # 24 tokens (two blocks of 16) where the context length allows
    params = SamplingParams(max_tokens=max(1, min(24, args.max_len - max(len(p) for p in prompts[:8]))),
                            temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine = build_engine(model, args, 8, attention=attention)
    engine.generate([[1, 2, 3]], params)
    engine.generate(prompts[:8], params)
    return time.perf_counter() - start, engine.runner.decode_attention_choice


def run_engine(model: GPTModel, prompts, outputs, args, max_num_seqs: int, cuda_graphs: bool = False,
               attention: str = "auto") -> tuple[list[Timing], float, list[list[int]]]:
    from meshtron.inference.request import SamplingParams

    engine = build_engine(model, args, max_num_seqs, cuda_graphs, attention)
    start = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
           for p, m in zip(prompts, outputs)]
    first: dict[str, float] = {}
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - start
        for out in outs:
            first.setdefault(out.req_id, now)
            if out.finished:
                done[out.req_id] = (now, out.token_ids)
    wall = time.perf_counter() - start
    timings = [Timing(first[i], done[i][0], len(done[i][1])) for i in ids]
    return timings, wall, [done[i][1] for i in ids]


class StepClock:
    """A logits processor that only notes when each generation step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_static_hf(hf_dir: Path, prompts, outputs, args) -> tuple[list[Timing], float, list[list[int]]]:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=getattr(torch, args.dtype)).eval().to(args.device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    timings: list[Optional[Timing]] = [None] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    start = time.perf_counter()
    for lo in range(0, len(prompts), args.batch_size):
        index = list(range(lo, min(lo + args.batch_size, len(prompts))))
        width = max(len(prompts[i]) for i in index)
        input_ids = torch.zeros(len(index), width, dtype=torch.long)
        mask = torch.zeros(len(index), width, dtype=torch.long)
        for row, i in enumerate(index):  # left padding: every prompt ends at the last column
            input_ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        longest = max(outputs[i] for i in index)
        clock = StepClock()
        with torch.inference_mode():
            input_ids, mask = input_ids.to(args.device), mask.to(args.device)
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=longest,
                                 min_new_tokens=longest, do_sample=False, logits_processor=LogitsProcessorList([clock]))
        _sync(args.device)
        for row, i in enumerate(index):
            n = outputs[i]
            tokens[i] = out[row, width:width + n].tolist()
            timings[i] = Timing(clock.times[0] - start, clock.times[n - 1] - start, n)
    return timings, time.perf_counter() - start, tokens


@torch.inference_mode()
def run_naive(model: GPTModel, prompts, outputs) -> tuple[list[Timing], float, list[list[int]]]:
    from meshtron.nn.context import KVCacheContext

    timings, tokens = [], []
    device = next(model.parameters()).device
    start = time.perf_counter()
    for prompt, n in zip(prompts, outputs):
        ctx = KVCacheContext(batch_size=1, max_len=len(prompt) + n)
        x, out, first = torch.tensor([prompt], device=device), [], 0.0
        for k in range(n):
            next_id = model(x, ctx.begin(x))[:, -1].argmax(-1)
            ctx.advance()
            out.append(int(next_id))
            if k == 0:
                first = time.perf_counter() - start
            x = next_id[:, None]
        timings.append(Timing(first, time.perf_counter() - start, n))
        tokens.append(out)
    return timings, time.perf_counter() - start, tokens


def convert_to_hf(model: GPTModel, workdir: Path) -> Optional[Path]:
    """Save a checkpoint and convert it with meshtron's converter; None without transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    import yaml

    from meshtron.checkpoint import CheckpointManager
    from meshtron.config.loader import config_to_dict
    from meshtron.config.schema import RunConfig
    from meshtron.models.hf.convert import meshtron_to_hf

    cfg = RunConfig(model=model.cfg)
    cfg.tokenizer.type = "byte"
    CheckpointManager(workdir / "ckpt").save(0, model, None, {"step": 0}, yaml.safe_dump(config_to_dict(cfg)))
    meshtron_to_hf(workdir / "ckpt", workdir / "hf", architecture="LlamaForCausalLM")
    return workdir / "hf"


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def weight_bytes(model: GPTModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_batch1(model: GPTModel, args) -> list[dict[str, Any]]:
    """Decode tokens/s of one request (prompt 16 tokens, --decode-tokens tokens), after the first
    token, against the bandwidth limit; CUDA only (the rows say n/a elsewhere)."""
    from meshtron.inference.request import SamplingParams

    if args.device != "cuda":
        return [{"cuda_graphs": "n/a", "decode_tokens_per_s": None, "bandwidth_limit_tokens_per_s": None,
                 "fraction_of_limit": None, "note": f"n/a on {args.device}: the limit is a GPU memory-bandwidth bound"}]
    # this GPU's bandwidth (datasheet by device name, else measured), not one model's for every GPU
    args.bandwidth_gbps, args.bandwidth_source = resolve_bandwidth_gbps(args.bandwidth_gbps, torch.device("cuda"))
    limit = args.bandwidth_gbps * 1e9 / weight_bytes(model)
    rows = []
    for graphs in graph_settings(args):
        engine = build_engine(model, args, max_num_seqs=1, cuda_graphs=graphs)
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
        engine.generate([list(range(16))], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        engine.add_request(list(range(1, 17)), params)
        engine.step()  # the prefill and the first token
        _sync(args.device)
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        _sync(args.device)
        rate = steps / (time.perf_counter() - start)
        rows.append({"cuda_graphs": "on" if graphs else "off", "decode_tokens_per_s": rate,
                     "bandwidth_limit_tokens_per_s": limit, "fraction_of_limit": rate / limit,
                     "graph_forwards": engine.runner.num_forwards["graph"], "bandwidth_gbps": args.bandwidth_gbps,
                     "bandwidth_source": args.bandwidth_source})
    return rows


def median_run(runs: list[tuple]) -> tuple:
    """The run of median wall time (the lower middle one for an even count) and every run's wall."""
    ordered = sorted(runs, key=lambda r: r[1])
    return ordered[(len(ordered) - 1) // 2], [r[1] for r in runs]


def timed(run) -> tuple:
    """run() -> (timings, wall, tokens), with the process CPU seconds it took appended: on a shared
    machine wall time also counts other programs' turns, CPU time (one thread) mostly does not."""
    cpu = time.process_time()
    timings, wall, tokens = run()
    return timings, wall, tokens, time.process_time() - cpu


def print_table(results: list[dict[str, Any]], notes: list[str]) -> None:
    print(f"{'system':<28}{'tok/s':>9}{'wall s':>9}{'tok/cpu-s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
          f"{'TPOT p99':>10}")
    for r in results:
        print(f"{r['system']:<28}{r['output_tokens_per_s']:>9.0f}{r['wall_s']:>9.1f}{r['output_tokens_per_cpu_s']:>10.0f}"
              f"{r['ttft_p50_ms']:>10.0f}{r['ttft_p99_ms']:>10.0f}{r['tpot_p50_ms']:>10.1f}{r['tpot_p99_ms']:>10.1f}")
    print("(TTFT and TPOT in ms; every request arrives at t=0)")
    for note in notes:
        print(note)


def print_decode(rows: list[dict[str, Any]], args) -> None:
    source = getattr(args, "bandwidth_source", "given")
    bandwidth = f"{args.bandwidth_gbps:.0f} GB/s ({source})" if args.bandwidth_gbps else "bandwidth"
    print(f"batch-1 decode ({args.decode_tokens} tokens; limit = {bandwidth} / weight bytes):")
    for r in rows:
        if r["decode_tokens_per_s"] is None:
            print(f"  cuda graphs n/a: tok/s n/a, limit n/a ({r['note']})")
        else:
            print(f"  cuda graphs {r['cuda_graphs']}: {r['decode_tokens_per_s']:.0f} tok/s, limit "
                  f"{r['bandwidth_limit_tokens_per_s']:.0f} tok/s ({r['fraction_of_limit']:.1%})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="benchmarks/serve.py", description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="serve", choices=["serve", "decode"],
                   help="serve: this throughput benchmark; decode: batch-1 decode against the memory-bandwidth limit "
                        "and torch's GEMV ceiling, with its own options (--mode decode --help)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(8, 128), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 128), metavar=("MIN", "MAX"))
    p.add_argument("--batch-size", type=int, default=32, help="static batch size (and the engine's first max_num_seqs)")
    p.add_argument("--engine-max-num-seqs", type=int, nargs="*", default=[128, 256],
                   help="further engine runs with these max_num_seqs (the paged cache wastes no memory on padding, "
                        "so the engine can run more requests at once than a static batch)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="engine token budget per step")
    p.add_argument("--decode-attention", nargs="+", default=["auto"], choices=list(DECODE_ATTENTION),
                   help="engine rows per engine.decode_attention: auto (the default engine: the native kernel on a "
                        "CPU where it builds, FlexAttention over the paged cache on CUDA), gather (gather + SDPA), "
                        "compiled, native, flex")
    p.add_argument("--naive-requests", type=int, default=None, help="run the naive loop on the first N only")
    p.add_argument("--skip", nargs="*", default=[], choices=["engine", "static", "naive", "decode"])
    p.add_argument("--pairs", type=int, default=3,
                   help="then time N interleaved pairs (static batches, engine at its largest concurrency and "
                        "last --decode-attention) and report the median ratio (0: none)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each system; the run of median wall time is reported")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations (bfloat16/float16 are for GPUs; ~400x slower on these CPUs)")
    p.add_argument("--cuda-graphs", default="both", choices=["on", "off", "both"],
                   help="CUDA only: engine and batch-1 decode runs with graphs on, off or both")
    p.add_argument("--bandwidth-gbps", type=float, default=None,
                   help="memory bandwidth for the batch-1 decode limit (default: the GPU's datasheet value by "
                        "device name, e.g. H100 SXM 3350, H200 4800; a measured copy for a GPU not in the table)")
    p.add_argument("--decode-tokens", type=int, default=256, help="tokens of the batch-1 decode measurement")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(DEFAULT_OUTPUT))
    return p


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name in ("repeats", "num_requests", "batch_size", "decode_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: {getattr(args, name)} must be >= 1")
    if args.pairs < 0:
        raise SystemExit(f"--pairs: {args.pairs} must be >= 0")
    if args.max_len < max(args.prompt_len) + max(args.output_len, default=0):
        raise SystemExit(f"--max-len: {args.max_len} is below the longest prompt + output "
                         f"({max(args.prompt_len) + max(args.output_len)}); raise it")
    args.device = resolve_device(args.device)
    args.decode_attention = list(dict.fromkeys(args.decode_attention))
    if args.device == "cuda" and "native" in args.decode_attention:
        args.decode_attention.remove("native")  # a CPU kernel; the table then has no native rows
        args.decode_attention = args.decode_attention or ["auto"]
    return args


def run_pairs(model: GPTModel, hf_dir: Path, prompts, outputs, args) -> list[dict[str, Any]]:
    """--pairs N: N interleaved (static batches, engine) runs, the engine at its largest concurrency with
    the last --decode-attention; one ratio per pair, so a slow spell of a shared machine hits both sides."""
    attention = args.decode_attention[-1]
    seqs = max(args.batch_size, *args.engine_max_num_seqs)
    pairs = []
    for _ in range(args.pairs):
        _, static_wall, _, static_cpu = timed(lambda: run_static_hf(hf_dir, prompts, outputs, args))
        _, engine_wall, _, engine_cpu = timed(lambda: run_engine(model, prompts, outputs, args, seqs,
                                                                 attention=attention))
        pairs.append({"engine": f"s={seqs}{DECODE_SUFFIX[attention]}", "static_wall_s": static_wall,
                      "engine_wall_s": engine_wall, "ratio": static_wall / engine_wall,
                      "static_cpu_s": static_cpu, "engine_cpu_s": engine_cpu, "cpu_ratio": static_cpu / engine_cpu})
    return pairs


def run_systems(model: GPTModel, prompts, outputs, args, results, notes, tokens, walls,
                pairs: list[dict[str, Any]]) -> None:
    def record(name: str, run) -> list[list[int]]:
        (timings, wall, out, cpu), all_walls = median_run([timed(run) for _ in range(args.repeats)])
        row = summarize(name, timings, wall)
        row.update(cpu_s=cpu, output_tokens_per_cpu_s=row["output_tokens"] / cpu)
        results.append(row)
        walls[name] = all_walls
        return out

    if "engine" not in args.skip:
        chosen = {}
        for attention in args.decode_attention:
            seconds, chosen[attention] = warm_up(model, prompts, args, attention)
            notes.append(f"decode attention {attention}: {chosen[attention]}, built and warmed up in {seconds:.1f} s "
                         "before the timed runs")
        for graphs, attention in [(g, a) for g in graph_settings(args) for a in args.decode_attention]:
            suffix = (" graphs" if graphs else "") + DECODE_SUFFIX[attention]
            for max_num_seqs in [args.batch_size, *args.engine_max_num_seqs]:
                engine_tokens = record(f"meshtron engine s={max_num_seqs}{suffix}",
                                       lambda s=max_num_seqs, g=graphs, a=attention:
                                       run_engine(model, prompts, outputs, args, s, g, a))
                results[-1]["decode_attention"] = chosen[attention]
                tokens.setdefault("engine", engine_tokens)
                if engine_tokens != tokens["engine"]:
                    notes.append(f"engine s={max_num_seqs}{suffix}: greedy tokens differ from the first engine run")
    if "static" not in args.skip:
        with tempfile.TemporaryDirectory(prefix="meshtron-bench-serve-") as tmp:
            hf_dir = convert_to_hf(model, Path(tmp))
            if hf_dir is None:
                notes.append("static batching skipped: transformers is not installed")
            else:
                tokens["static"] = record(f"transformers static b={args.batch_size}",
                                          lambda: run_static_hf(hf_dir, prompts, outputs, args))
                if args.pairs and "engine" not in args.skip:
                    pairs[:] = run_pairs(model, hf_dir, prompts, outputs, args)
    if "naive" not in args.skip:
        n = args.naive_requests or len(prompts)
        name = "naive one-at-a-time" + (f" (first {n})" if n < len(prompts) else "")
        tokens["naive"] = record(name, lambda: run_naive(model, prompts[:n], outputs[:n]))


def summarize_ratios(results, notes, tokens, args, pairs: list[dict[str, Any]]) -> dict[str, Any]:
    by_name: dict[str, dict[str, Any]] = {}
    for r in results:  # the first engine row is the one at the static batch's concurrency
        by_name.setdefault(r["system"].split()[0], r)
    summary: dict[str, Any] = {}
    if "meshtron" in by_name and "transformers" in by_name:
        static = by_name["transformers"]["output_tokens_per_s"]
        summary["engine_over_static"] = by_name["meshtron"]["output_tokens_per_s"] / static
        best = max((r for r in results if r["system"].startswith("meshtron")), key=lambda r: r["output_tokens_per_s"])
        summary["best_engine_over_static"] = best["output_tokens_per_s"] / static
        notes.append(f"engine / static-batch throughput at equal concurrency ({args.batch_size}): "
                     f"{summary['engine_over_static']:.2f}x; best engine row ({best['system']}): "
                     f"{summary['best_engine_over_static']:.2f}x (goal >= {GOAL_RATIO:.0f}x)")
        summary["engine_over_static_cpu"] = (by_name["meshtron"]["output_tokens_per_cpu_s"]
                                             / by_name["transformers"]["output_tokens_per_cpu_s"])
        notes.append(f"the same per CPU second (steadier on a shared machine): {summary['engine_over_static_cpu']:.2f}x")
    if pairs:
        ratios = [p["ratio"] for p in pairs]
        cpu_ratios = [p["cpu_ratio"] for p in pairs]
        summary["paired_engine_over_static"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                "max": max(ratios), "engine": pairs[0]["engine"],
                                                "cpu_median": statistics.median(cpu_ratios)}
        notes.append(f"{len(pairs)} interleaved pairs (static, engine {pairs[0]['engine']}): ratios "
                     + ", ".join(f"{r:.2f}" for r in ratios) + f"; median {statistics.median(ratios):.2f}x "
                     f"(per CPU second: median {statistics.median(cpu_ratios):.2f}x)")
    if "meshtron" in by_name and "naive" in by_name:
        summary["engine_over_naive"] = by_name["meshtron"]["output_tokens_per_s"] / by_name["naive"]["output_tokens_per_s"]
        notes.append(f"engine / naive throughput: {summary['engine_over_naive']:.2f}x")
    for other in ("static", "naive"):
        if "engine" in tokens and other in tokens:
            k = len(tokens[other])
            summary[f"greedy_agreement_engine_{other}"] = agreement(tokens["engine"][:k], tokens[other])
            notes.append(f"requests with identical greedy tokens, engine vs {other}: "
                         f"{summary[f'greedy_agreement_engine_{other}']:.0%}")
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    mode = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    mode.add_argument("--mode", default="serve", choices=["serve", "decode"])
    if mode.parse_known_args(argv)[0].mode == "decode":  # its own options (serve_decode.build_parser)
        from meshtron.bench.serve_decode import main as decode_main

        return decode_main(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts, outputs = build_workload(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len))
    model = build_model(args)
    results: list[dict[str, Any]] = []
    notes: list[str] = []
    tokens: dict[str, list[list[int]]] = {}
    walls: dict[str, list[float]] = {}
    pairs: list[dict[str, Any]] = []
    run_systems(model, prompts, outputs, args, results, notes, tokens, walls, pairs)
    summary = summarize_ratios(results, notes, tokens, args, pairs)
    decode = decode_batch1(model, args) if "decode" not in args.skip else []
    print_table(results, notes)
    if decode:
        print_decode(decode, args)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "machine": platform.platform(), "torch": torch.__version__,
                               "date": time.strftime("%Y-%m-%d", time.gmtime()), "results": results,
                               "walls_s": walls, "pairs": pairs, "summary": summary, "decode_batch1": decode}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
