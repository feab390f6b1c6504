"""Batch-1 decode against the memory-bandwidth limit (`benchmarks/serve.py --mode decode`, issue 22).

Decoding one request reads every weight once per token, so its speed is bounded by how fast the
machine reads memory. One run measures, on the same machine and in the same process:
  - the memory-read bandwidth: numpy sums of a buffer far larger than the caches, split over
    --threads threads (the median of --repeats);
  - torch's own fp32 GEMV throughput over the model's weights: each linear layer's weight as one
    matrix-vector product (batch 1), a pass over all of them timed: the ceiling of a decode step
    without hand-written kernels;
  - the bytes one decode step reads: every parameter but the embedding table (a row lookup), plus
    the keys and values attention reads at the run's mean context length;
  - batch-1 greedy tokens/s (after the first token) of meshtron's engine in fp32, with int8
    weight-only quantization (engine.quantize), with speculative decoding drafting from a trained
    MTP head (engine.speculative_method mtp, on the --mtp-checkpoint model, against the same
    checkpoint without it), and of transformers' `generate` on the same weights (the random model
    converted with meshtron's converter; same greedy tokens checked).
Each rate is reported as a fraction of the bandwidth limit (bandwidth / bytes per step) and of the
GEMV ceiling (GEMV throughput / bytes per step). Repeats interleave the systems, and each repeat's
ratios use that repeat's own GEMV timing: on a shared machine a slow spell hits both sides of a ratio.
A second GEMV fraction (p10) compares the fastest tenth of token times with the fastest tenth of GEMV
passes, both seen while other programs happened to leave the cores alone.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from meshtron.bench.serve import StepClock
from meshtron.config.schema import ModelConfig
from meshtron.models import GPTModel

DEFAULT_OUTPUT = Path("benchmarks/results/serve_decode.json")
DEFAULT_MTP_CHECKPOINT = "runs/tiny-mtp/checkpoints"
# the goals: fp32 at >= 90% of the GEMV ceiling, int8 weight-only >= 2x fp32, MTP speculative >= 1.5x
GOAL_FP32_OF_GEMV, GOAL_INT8_SPEEDUP, GOAL_SPECULATIVE_SPEEDUP = 0.9, 2.0, 1.5
SYSTEMS = ("fp32", "int8", "speculative", "transformers")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="benchmarks/serve.py --mode decode", description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="decode", choices=["decode"], help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (grouped-query attention)")
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per timed request")
    p.add_argument("--int8-decode-tokens", type=int, default=16,
                   help="tokens of the int8 row's requests (torchao's int8 weight-only runs ~10x slower than fp32 on "
                        "a CPU, docs/benchmarks.md); its tokens are compared with fp32's on this prefix")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds of every measurement; medians reported")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads and bandwidth threads")
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="buffer read by the bandwidth measurement")
    p.add_argument("--skip", nargs="*", default=[], choices=list(SYSTEMS))
    p.add_argument("--mtp-checkpoint", default=DEFAULT_MTP_CHECKPOINT,
                   help="checkpoint with a trained MTP depth for the speculative rows (configs/tiny-mtp.yaml trains one)")
    p.add_argument("--num-speculative-tokens", type=int, default=2)
    p.add_argument("--speculative-prompt", default="import os\nimport sys\n\n\ndef main(argv):\n",
                   help="prompt of the speculative rows (text, in the checkpoint's tokenizer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(DEFAULT_OUTPUT))
    return p


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name in ("repeats", "threads", "decode_tokens", "prompt_len", "bandwidth_mb", "num_speculative_tokens",
                 "int8_decode_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: {getattr(args, name)} must be >= 1")
    if args.decode_tokens < 2:
        raise SystemExit(f"--decode-tokens: {args.decode_tokens} must be >= 2 (the rate counts tokens after the first)")
    if args.max_len < args.prompt_len + args.decode_tokens:
        raise SystemExit(f"--max-len: {args.max_len} is below --prompt-len + --decode-tokens "
                         f"({args.prompt_len + args.decode_tokens}); raise it")
    if args.heads % args.kv_heads or args.hidden_size % args.heads:
        raise SystemExit(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}, and --heads --hidden-size "
                         f"{args.hidden_size}")
    return args


def build_model(args: argparse.Namespace) -> GPTModel:
    """A random Llama-shaped model (RMSNorm, SwiGLU, RoPE, GQA, untied head), so the Llama converter applies."""
    torch.manual_seed(args.seed)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden_size, num_attention_heads=args.heads,
                      num_query_groups=args.kv_heads, ffn_hidden_size=args.ffn, max_position_embeddings=args.max_len,
                      vocab_size=args.vocab, make_vocab_size_divisible_by=1, init_method_std=0.02)
    return GPTModel(cfg).eval()


# ---- the limits -------------------------------------------------------------------------------------

def measure_bandwidth(num_bytes: int, threads: int, repeats: int) -> dict[str, Any]:
    """Memory-read GB/s: numpy sums (which release the GIL) of `threads` slices of one buffer, in parallel."""
    buffer = np.ones(num_bytes // 4, dtype=np.float32)  # written once, so every page is mapped before timing
    parts = np.array_split(buffer, threads)
    rates = []
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.add.reduce, parts))  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.add.reduce, parts))
            rates.append(buffer.nbytes / (time.perf_counter() - start) / 1e9)
    return {"gbps": statistics.median(rates), "runs_gbps": rates, "buffer_bytes": buffer.nbytes, "threads": threads,
            "method": "numpy add.reduce"}


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """The decode step's linear weights: the MTP depths' are not (they only draft, speculative_method mtp)."""
    return [m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear) and not name.startswith("mtp.")]


@torch.inference_mode()
def gemv_pass_seconds(weights: list[torch.Tensor], passes: int = 5) -> list[float]:
    """Seconds of each of `passes` passes of batch-1 matrix-vector products over `weights`, shaped as the
    model runs them: x (1, 1, in) @ W^T."""
    inputs = {w.shape[1]: torch.randn(1, 1, w.shape[1], dtype=w.dtype) for w in weights}
    for w in weights:  # warm-up
        nn.functional.linear(inputs[w.shape[1]], w)
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for w in weights:
            nn.functional.linear(inputs[w.shape[1]], w)
        times.append(time.perf_counter() - start)
    return times


def step_bytes(model: GPTModel, context_lengths: list[int]) -> dict[str, float]:
    """Bytes one decode step reads: every parameter except embedding tables (a lookup reads one row) and
    MTP depths (drafters only), plus keys and values at the mean context length of the timed steps."""
    from meshtron.inference.runner import kv_bytes_per_token

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    weights = sum(tensor_bytes(p) for name, p in model.named_parameters()
                  if id(p) not in embeddings and not name.startswith("mtp."))
    kv = kv_bytes_per_token(model) * statistics.fmean(context_lengths)
    return {"weight_bytes": weights, "kv_bytes_mean": kv, "per_step": weights + kv}


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a parameter, of a torchao quantized one too (its int data plus its scales)."""
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = inner()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


# ---- the systems ------------------------------------------------------------------------------------

def build_engine(model: nn.Module, tokenizer, **options):
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine

    return LLMEngine(model, tokenizer, EngineConfig(device="cpu", max_num_seqs=1, **options))


def engine_decode(engine, prompt: list[int], num_tokens: int) -> tuple[float, list[int], dict[str, Any]]:
    """One greedy request; -> (tokens/s after the first token, its tokens, its speculative acceptance rate
    where the engine drafts)."""
    from meshtron.inference.request import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))
    first = []
    while not first:  # the prefill (in chunks if it exceeds the step budget) and the first token
        first = engine.step()
    start, last, token_seconds = time.perf_counter(), first[-1], []
    while engine.has_unfinished_requests():
        step_start, num_before = time.perf_counter(), len(last.token_ids)
        for out in engine.step():
            last = out
        num_new = len(last.token_ids) - num_before
        token_seconds += [(time.perf_counter() - step_start) / num_new] * num_new
    rate = (len(last.token_ids) - len(first[-1].token_ids)) / (time.perf_counter() - start)
    info: dict[str, Any] = {"token_seconds": token_seconds}
    if getattr(last, "acceptance_rate", None) is not None:
        info["acceptance_rate"] = last.acceptance_rate
    return rate, list(last.token_ids), info


def transformers_decode(hf_model, prompt: list[int], num_tokens: int) -> tuple[float, list[int], dict[str, Any]]:
    from transformers import LogitsProcessorList

    clock = StepClock()
    with torch.inference_mode():
        out = hf_model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                                logits_processor=LogitsProcessorList([clock]))
    times = clock.times[:num_tokens]
    return ((num_tokens - 1) / (times[-1] - times[0]), out[0, len(prompt):].tolist(),
            {"token_seconds": [b - a for a, b in zip(times, times[1:])]})


def load_transformers(model: GPTModel, workdir: Path):
    from transformers import AutoModelForCausalLM

    from meshtron.bench.serve import convert_to_hf

    hf_dir = convert_to_hf(model, workdir)
    hf_model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    return hf_model


def unavailable_quantize() -> Optional[str]:
    """Why int8 weight-only cannot run here, or None."""
    from meshtron.inference.config import EngineConfig

    if "quantize" not in EngineConfig.__dataclass_fields__:
        return "engine.quantize does not exist in this tree"
    try:
        from meshtron.nn.torchao import import_torchao

        import_torchao()
    except ImportError as e:
        return str(e)
    return None


def unavailable_speculative(path: str) -> Optional[str]:
    from meshtron.inference.config import EngineConfig

    if "speculative_method" not in EngineConfig.__dataclass_fields__:
        return "engine.speculative_method does not exist in this tree"
    if not Path(path).exists():
        return (f"no trained MTP checkpoint at {path} (train one: meshtron train --config configs/tiny-mtp.yaml; "
                "or pass --mtp-checkpoint)")
    return None


# ---- one run ----------------------------------------------------------------------------------------

class Runs:
    """Per system: its decode function, the bytes of its step and its limits' denominators, and the
    rates of every repeat."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}
        self.decode: dict[str, Callable[[], tuple[float, list[int], dict[str, Any]]]] = {}

    def add(self, name: str, model: str, decode: Optional[Callable], note: str = "", **fields) -> None:
        self.rows[name] = {"system": name, "model": model, "rates": [], "note": note, "info": [], **fields}
        if decode is not None:
            self.decode[name] = decode


def setup_systems(model: GPTModel, args, workdir: Path, runs: Runs, prompt: list[int]) -> dict[str, Any]:
    """Build every system once (engines, the quantized copy, the transformers model, the MTP checkpoint's
    two engines) and register its decode function; -> the speculative model's own limits' inputs."""
    from meshtron.data.tokenizer import ByteTokenizer

    n = args.decode_tokens
    name = f"random {args.layers} x {args.hidden_size}"
    if "fp32" not in args.skip:
        engine = build_engine(model, ByteTokenizer())
        runs.add("meshtron fp32", name, lambda: engine_decode(engine, prompt, n))
    if "int8" not in args.skip:
        reason = unavailable_quantize()
        if reason is None:
            quantized = copy.deepcopy(model)
            engine8 = build_engine(quantized, ByteTokenizer(), quantize="int8-weight-only")
            n8 = max(2, min(n, args.int8_decode_tokens))
            runs.add("meshtron int8 weight-only", name, lambda: engine_decode(engine8, prompt, n8),
                     bytes_model=quantized)
        else:
            runs.add("meshtron int8 weight-only", name, None, f"not available: {reason}")
    if "transformers" not in args.skip:
        try:
            hf_model = load_transformers(model, workdir)
            runs.add("transformers fp32", name, lambda: transformers_decode(hf_model, prompt, n))
        except ImportError as e:
            runs.add("transformers fp32", name, None, f"not available: {e}")
    if "speculative" not in args.skip:
        return setup_speculative(args, runs)
    return {}


def setup_speculative(args, runs: Runs) -> dict[str, Any]:
    reason = unavailable_speculative(args.mtp_checkpoint)
    name = f"speculative mtp k={args.num_speculative_tokens}"
    if reason is not None:
        runs.add(f"meshtron {name}", "MTP checkpoint", None, f"not available: {reason}")
        return {}
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine

    try:
        base = LLMEngine.from_checkpoint(args.mtp_checkpoint, EngineConfig(device="cpu", max_num_seqs=1))
        spec = LLMEngine.from_checkpoint(args.mtp_checkpoint, EngineConfig(
            device="cpu", max_num_seqs=1, speculative_method="mtp", num_speculative_tokens=args.num_speculative_tokens))
    except (OSError, ValueError, RuntimeError) as e:  # CheckpointError and ConfigError are among these
        runs.add(f"meshtron {name}", "MTP checkpoint", None, f"not available: {args.mtp_checkpoint}: {e}")
        return {}
    prompt = base.tokenizer.encode(args.speculative_prompt)
    model = base.runner.model
    label = f"MTP checkpoint ({model.cfg.num_layers} x {model.cfg.hidden_size})"
    runs.add("meshtron fp32 (MTP checkpoint)", label, lambda: engine_decode(base, prompt, args.decode_tokens))
    runs.add(f"meshtron {name}", label, lambda: engine_decode(spec, prompt, args.decode_tokens))
    return {"model": model, "prompt_len": len(prompt)}


def run_repeats(runs: Runs, args, weights: list[torch.Tensor], spec: dict[str, Any]) -> list[dict[str, float]]:
    """--repeats rounds: bandwidth, GEMV passes (of both models), then every system once."""
    rounds = []
    for _ in range(args.repeats):
        r = {"bandwidth_gbps": measure_bandwidth(args.bandwidth_mb << 20, args.threads, 1)["gbps"],
             "gemv_passes_s": gemv_pass_seconds(weights)}
        r["gemv_s"] = statistics.median(r["gemv_passes_s"])
        if spec:
            r["gemv_passes_s_mtp"] = gemv_pass_seconds(linear_weights(spec["model"]))
            r["gemv_s_mtp"] = statistics.median(r["gemv_passes_s_mtp"])
        for name, decode in runs.decode.items():
            rate, tokens, info = decode()
            runs.rows[name]["rates"].append(rate)
            runs.rows[name]["info"].append(info)
            runs.rows[name]["tokens"] = tokens
        rounds.append(r)
    return rounds


# ---- the report -------------------------------------------------------------------------------------

def summarize(runs: Runs, rounds: list[dict[str, float]], model: GPTModel, args, spec: dict[str, Any]) -> dict:
    """Per row: median tokens/s, the bytes its step reads, and per-repeat ratios (medians) to its model's
    bandwidth limit and GEMV ceiling (fp32 weights) and to fp32 on the same model."""
    n = args.decode_tokens
    limits = {"random": model_limits(model, args.prompt_len, n, rounds, "gemv_s")}
    if spec:
        limits["mtp"] = model_limits(spec["model"], spec["prompt_len"], n, rounds, "gemv_s_mtp")
    references = {"random": "meshtron fp32", "mtp": "meshtron fp32 (MTP checkpoint)"}
    rows = []
    for name, row in runs.rows.items():
        key = "mtp" if row["model"].startswith("MTP") else "random"
        bytes_model = row.pop("bytes_model", None)
        info = row.pop("info")
        out = {k: v for k, v in row.items() if k != "tokens"}
        if not row["rates"]:
            rows.append({**out, "tok_per_s": None})
            continue
        lim = limits[key]
        rates = row["rates"]
        own_bytes = step_bytes(bytes_model, lim["context_lengths"])["per_step"] if bytes_model else lim["per_step"]
        out.update(tok_per_s=statistics.median(rates), bytes_per_step=own_bytes,
                   effective_gbps=statistics.median(rates) * own_bytes / 1e9,
                   of_bandwidth_limit=statistics.median(r / b for r, b in zip(rates, lim["bandwidth_tok_s"])),
                   of_gemv_ceiling=statistics.median(r / g for r, g in zip(rates, lim["gemv_tok_s"])))
        ref = runs.rows.get(references[key])
        if ref is not None and ref["rates"] and name != references[key]:
            out["x_fp32"] = statistics.median(r / f for r, f in zip(rates, ref["rates"]))
            k = min(len(row["tokens"]), len(ref["tokens"]))
            out["same_tokens"] = row["tokens"][:k] == ref["tokens"][:k]  # int8 runs fewer tokens: its prefix
            out["compared_tokens"] = k
            out["token_agreement"] = sum(a == b for a, b in zip(row["tokens"][:k], ref["tokens"][:k])) / max(k, 1)
        accepted = [i["acceptance_rate"] for i in info if "acceptance_rate" in i]
        if accepted:
            out["acceptance_rate"] = statistics.median(accepted)
        # the fastest decile of token times against the fastest decile of GEMV passes: what each side does
        # when other programs leave the cores alone (on a shared machine the medians carry their turns too)
        token_p10 = float(np.percentile([t for i in info for t in i["token_seconds"]], 10))
        out.update(token_p10_s=token_p10, of_gemv_ceiling_p10=lim["per_step"] * lim["gemv_pass_p10_s"]
                   / (lim["linear_bytes"] * token_p10))
        rows.append(out)
    return {"limits": {k: {f: v for f, v in lim.items() if f != "context_lengths"} for k, lim in limits.items()},
            "rows": rows}


def model_limits(model: GPTModel, prompt_len: int, num_tokens: int, rounds: list[dict[str, float]],
                 gemv_key: str) -> dict[str, Any]:
    """One model's bytes per step and, per repeat, its bandwidth limit and GEMV ceiling in tokens/s."""
    contexts = [prompt_len + j + 1 for j in range(1, num_tokens)]  # keys each timed step attends
    nbytes = step_bytes(model, contexts)
    linear_bytes = sum(w.numel() * w.element_size() for w in linear_weights(model))
    gemv_gbps = [linear_bytes / r[gemv_key] / 1e9 for r in rounds]
    passes = [t for r in rounds for t in r[gemv_key.replace("gemv_s", "gemv_passes_s")]]
    return {**nbytes, "context_lengths": contexts, "linear_bytes": linear_bytes,
            "bandwidth_gbps": statistics.median(r["bandwidth_gbps"] for r in rounds),
            "gemv_gbps": statistics.median(gemv_gbps), "gemv_pass_p10_s": float(np.percentile(passes, 10)),
            "bandwidth_tok_s": [r["bandwidth_gbps"] * 1e9 / nbytes["per_step"] for r in rounds],
            "gemv_tok_s": [g * 1e9 / nbytes["per_step"] for g in gemv_gbps],
            "bandwidth_limit_tok_s": statistics.median(r["bandwidth_gbps"] for r in rounds) * 1e9 / nbytes["per_step"],
            "gemv_ceiling_tok_s": statistics.median(gemv_gbps) * 1e9 / nbytes["per_step"]}


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["system"]: r for r in rows}

    def value(name: str, field: str) -> Optional[float]:
        return next((r.get(field) for n, r in by.items() if n.startswith(name) and r.get(field) is not None), None)

    checks = {"fp32_of_gemv_ceiling": (value("meshtron fp32", "of_gemv_ceiling"), GOAL_FP32_OF_GEMV),
              "int8_over_fp32": (value("meshtron int8", "x_fp32"), GOAL_INT8_SPEEDUP),
              "speculative_over_fp32": (value("meshtron speculative", "x_fp32"), GOAL_SPECULATIVE_SPEEDUP)}
    return {k: {"value": v, "goal": g, "met": None if v is None else v >= g} for k, (v, g) in checks.items()}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def print_report(report: dict[str, Any], args) -> None:
    lim = report["limits"]["random"]
    print(f"batch-1 greedy decode: {args.prompt_len}-token prompt, {args.decode_tokens} tokens, {args.threads} "
          f"threads, median of {args.repeats} interleaved repeats ({report['cpu']})")
    print(f"memory-read bandwidth {lim['bandwidth_gbps']:.1f} GB/s (numpy, {args.threads} threads, "
          f"{args.bandwidth_mb} MB); torch fp32 GEMV over the weights {lim['gemv_gbps']:.1f} GB/s")
    for key, label in (("random", f"random {args.layers} x {args.hidden_size}"), ("mtp", "MTP checkpoint")):
        if key in report["limits"]:
            m = report["limits"][key]
            print(f"{label}: {m['per_step'] / 1e6:.1f} MB per step ({m['weight_bytes'] / 1e6:.1f} MB weights "
                  f"without the embedding + {m['kv_bytes_mean'] / 1e6:.2f} MB keys/values); limit "
                  f"{m['bandwidth_limit_tok_s']:.1f} tok/s (bandwidth), {m['gemv_ceiling_tok_s']:.1f} tok/s (GEMV)")
    print(f"{'system':<36}{'tok/s':>8}{'x fp32':>8}{'of limit':>10}{'of GEMV':>9}{'p10':>7}{'GB/s':>7}  same tokens")
    for r in report["rows"]:
        if r["tok_per_s"] is None:
            print(f"{r['system']:<36}{'n/a':>8}  {r['note']}")
            continue
        same = "" if "same_tokens" not in r else ("yes" if r["same_tokens"] else f"no ({r['token_agreement']:.0%})")
        x = f"{r['x_fp32']:.2f}" if "x_fp32" in r else "1.00"
        accepted = f", {r['acceptance_rate']:.0%} of drafts accepted" if "acceptance_rate" in r else ""
        print(f"{r['system']:<36}{r['tok_per_s']:>8.1f}{x:>8}{r['of_bandwidth_limit']:>10.1%}"
              f"{r['of_gemv_ceiling']:>9.1%}{r['of_gemv_ceiling_p10']:>7.0%}{r['effective_gbps']:>7.1f}  {same}{accepted}")
    for name, g in report["goals"].items():
        state = "n/a" if g["value"] is None else ("met" if g["met"] else "not met")
        shown = "n/a" if g["value"] is None else f"{g['value']:.2f}"
        print(f"goal {name} >= {g['goal']}: {shown} ({state})")
    print("(of limit / of GEMV: medians of per-repeat ratios; p10: of GEMV from the fastest tenth of token times and "
          "of GEMV passes; GB/s: the row's own bytes per token x tok/s)")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args)
    prompt = torch.randint(0, args.vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    runs = Runs()
    with tempfile.TemporaryDirectory(prefix="meshtron-bench-decode-") as tmp:
        spec = setup_systems(model, args, Path(tmp), runs, prompt)
        for decode in runs.decode.values():  # warm-up: first calls, kernel builds, allocator
            decode()
        rounds = run_repeats(runs, args, linear_weights(model), spec)
    report = summarize(runs, rounds, model, args, spec)
    report.update(cpu=cpu_name(), goals=goals(report["rows"]))
    print_report(report, args)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "machine": platform.platform(), "cpu": report["cpu"],
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
                               "rounds": rounds, **{k: v for k, v in report.items() if k != "cpu"}}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
