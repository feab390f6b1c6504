"""Hybrid Mamba models against pure attention of the same size: training throughput, peak memory and
decode time per token as the sequence grows.

Models (random weights, byte vocabulary): an M-heavy hybrid derived from ratios (default 8 sublayers:
1/8 attention, 1/4 MLP, the rest Mamba-2) and a pure-attention '*-' stack whose MLP width is solved
so its parameter count matches the hybrid's; for decoding also a pure Mamba-2 stack of that size.
- Training: for each sequence length, a fresh process builds the model and runs warm-up + timed
  forward/backward/AdamW steps over `--tokens-per-step` tokens (batch = tokens / length); it reports
  the best step's tokens/s and the process's peak resident memory above what it held before the
  first step (model, optimizer state and allocator included; the process is fresh, so earlier
  lengths leave nothing behind).
- Decoding: prefill a prompt of each length through the model's cache context (KV for attention,
  conv + SSM state for Mamba), then time single-token steps; best ms per token. Attention reads
  a cache that grows with the length; the Mamba state does not.
Times are the process's CPU time (`time.process_time`) with one torch thread by default, the best
of the timed repeats: on a shared machine wall-clock time also counts other people's work, and
even CPU time stretches when a neighbour shares the core, so the least disturbed repeat is the
estimate (on a quiet machine with one thread they agree; wall times are recorded too). Ratios are
hybrid / attention in the same run.

    python benchmarks/mamba.py [--train-lengths 512,1024,2048,4096] [--decode-lengths 512,...,8192] ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_OUTPUT = Path("benchmarks/results/mamba.json")
VOCAB = 262  # the byte tokenizer's vocabulary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="meshtron bench mamba", description=__doc__.split("\n\n")[0])

    def lengths(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    p.add_argument("--train-lengths", type=lengths, default=[512, 1024, 2048, 4096],
                   help="training sequence lengths (default 512,1024,2048,4096; add 8192 for the full sweep)")
    p.add_argument("--decode-lengths", type=lengths, default=[512, 1024, 2048, 4096, 8192],
                   help="prompt lengths before timing decode steps (default 512..8192)")
    p.add_argument("--tokens-per-step", type=int, default=4096, help="tokens per training step (default 4096)")
    p.add_argument("--steps", type=int, default=3, help="timed training steps per length; the best counts (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed training steps first (default 1)")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per length (default 16)")
    p.add_argument("--hidden-size", type=int, default=256, help="model width (default 256)")
    p.add_argument("--sublayers", type=int, default=8, help="sublayers of the hybrid (default 8)")
    p.add_argument("--attention-ratio", type=float, default=0.125, help="hybrid attention ratio (default 0.125)")
    p.add_argument("--mlp-ratio", type=float, default=0.25, help="hybrid MLP ratio (default 0.25)")
    p.add_argument("--attention-layers", type=int, default=4, help="'*-' layers of the baseline (default 4)")
    p.add_argument("--mamba-state", type=int, default=64, help="Mamba state size N (default 64)")
    p.add_argument("--mamba-groups", type=int, default=1, help="Mamba B/C groups (default 1)")
    p.add_argument("--chunk-size", type=int, default=128, help="SSD chunk length (default 128)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per measurement (default 1: steady timings on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON results (default {DEFAULT_OUTPUT})")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one training measurement
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def model_configs(args: argparse.Namespace) -> dict[str, Any]:
    """{'hybrid', 'attention', 'mamba'} ModelConfigs of (nearly) equal parameter count."""
    from meshtron.config.schema import ModelConfig
    from meshtron.models.accounting import count_parameters

    common = dict(hidden_size=args.hidden_size, num_attention_heads=4, vocab_size=VOCAB,
                  make_vocab_size_divisible_by=1, max_position_embeddings=16384, position_embedding_type="rope",
                  mamba_state_dim=args.mamba_state, mamba_num_groups=args.mamba_groups,
                  mamba_chunk_size=args.chunk_size, init_method_std=0.02)
    hybrid = ModelConfig(hybrid_num_sublayers=args.sublayers, hybrid_attention_ratio=args.attention_ratio,
                         hybrid_mlp_ratio=args.mlp_ratio, **common)
    target = count_parameters(hybrid, VOCAB)

    def matched(pattern: str, **kw) -> ModelConfig:
        """The pattern with the MLP width that brings the parameter count closest to the hybrid's."""
        lo, hi = 1, 64 * args.hidden_size
        while lo < hi:  # the count grows with the MLP width
            mid = (lo + hi) // 2
            if count_parameters(ModelConfig(layer_pattern=pattern, ffn_hidden_size=mid, **kw, **common), VOCAB) < target:
                lo = mid + 1
            else:
                hi = mid
        return ModelConfig(layer_pattern=pattern, ffn_hidden_size=lo, **kw, **common)

    attention = matched("*-" * args.attention_layers)
    per_mamba = count_parameters(ModelConfig(layer_pattern="MM", **common), VOCAB) - \
        count_parameters(ModelConfig(layer_pattern="M", **common), VOCAB)
    base = count_parameters(ModelConfig(layer_pattern="M", **common), VOCAB) - per_mamba
    mamba = ModelConfig(layer_pattern="M" * max(1, round((target - base) / per_mamba)), **common)
    for cfg in (hybrid, attention, mamba):
        cfg.validate()
    return {"hybrid": hybrid, "attention": attention, "mamba": mamba}


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def train_worker(args: argparse.Namespace, name: str, seq: int) -> dict[str, Any]:
    """In a fresh process: tokens/s of forward/backward/AdamW steps and the peak memory they add."""
    import torch

    from meshtron.models import GPTModel

    torch.set_num_threads(args.threads)
    cfg = model_configs(args)[name]
    torch.manual_seed(args.seed)
    model = GPTModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = max(1, args.tokens_per_step // seq)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(args.seed))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    before = current_rss_bytes()
    cpu, wall = [], []
    for i in range(args.warmup + args.steps):
        t0, w0 = time.process_time(), time.perf_counter()
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= args.warmup:
            cpu.append(time.process_time() - t0)
            wall.append(time.perf_counter() - w0)
    step = min(cpu)
    return {"model": name, "seq_length": seq, "batch": batch, "step_cpu_s": step, "step_wall_s": min(wall),
            "tokens_per_s": batch * seq / step, "peak_mem_mb": (peak_rss_bytes() - before) / 2**20, "loss": float(loss)}


def run_training(args: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    rows = []
    root = str(Path(__file__).resolve().parents[2])  # this checkout's meshtron, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for seq in args.train_lengths:
        for name in ("hybrid", "attention"):
            cmd = [sys.executable, "-m", "meshtron.bench.mamba", *argv, "--worker", f"{name}:{seq}"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            if out.returncode != 0:
                raise RuntimeError(f"training {name} at {seq} tokens failed:\n{out.stderr[-2000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  train {name:9s} seq {seq:5d}: {rows[-1]['tokens_per_s']:8.0f} tokens/s, "
                  f"{rows[-1]['peak_mem_mb']:7.0f} MB", flush=True)
    return rows


def run_decoding(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from meshtron.models import GPTModel
    from meshtron.nn.context import KVCacheContext

    torch.set_num_threads(args.threads)
    rows = []
    g = torch.Generator().manual_seed(args.seed)
    for name, cfg in model_configs(args).items():
        torch.manual_seed(args.seed)
        model = GPTModel(cfg).eval()
        for seq in args.decode_lengths:
            prompt = torch.randint(0, VOCAB, (1, seq), generator=g)
            ctx = KVCacheContext(1, seq + args.decode_steps + 1)
            with torch.inference_mode():
                t0 = time.process_time()
                next_id = model(prompt, ctx.begin(prompt))[:, -1:].argmax(-1)
                prefill = time.process_time() - t0
                ctx.advance()
                cpu, wall = [], []
                for _ in range(args.decode_steps):
                    t0, w0 = time.process_time(), time.perf_counter()
                    next_id = model(next_id, ctx.begin(next_id))[:, -1:].argmax(-1)
                    ctx.advance()
                    cpu.append(time.process_time() - t0)
                    wall.append(time.perf_counter() - w0)
            rows.append({"model": name, "context": seq, "decode_ms_per_token": min(cpu) * 1e3,
                         "decode_median_ms_per_token": statistics.median(cpu) * 1e3,
                         "decode_wall_ms_per_token": min(wall) * 1e3, "prefill_cpu_s": prefill})
            print(f"  decode {name:9s} context {seq:5d}: {rows[-1]['decode_ms_per_token']:6.2f} ms/token", flush=True)
    return rows


def summarize(train: list[dict], decode: list[dict]) -> dict[str, Any]:
    def by(rows: list[dict], key: str) -> dict[tuple[str, int], dict]:
        return {(r["model"], r[key]): r for r in rows}

    t, d = by(train, "seq_length"), by(decode, "context")
    ratios = {}
    for seq in sorted({r["seq_length"] for r in train}):
        h, a = t[("hybrid", seq)], t[("attention", seq)]
        ratios[seq] = {"tokens_per_s": h["tokens_per_s"] / a["tokens_per_s"], "peak_mem": h["peak_mem_mb"] / a["peak_mem_mb"]}
    contexts = sorted({r["context"] for r in decode})
    growth = {m: d[(m, contexts[-1])]["decode_ms_per_token"] / d[(m, contexts[0])]["decode_ms_per_token"]
              for m in sorted({r["model"] for r in decode})}
    return {"train_hybrid_over_attention": ratios, "decode_growth_longest_over_shortest": growth}


def print_tables(train: list[dict], decode: list[dict], summary: dict) -> None:
    print("\ntraining tokens per CPU-second (best step) and peak memory above the pre-step process")
    print(f"{'seq':>6} {'hybrid tok/s':>13} {'attn tok/s':>11} {'ratio':>6} {'hybrid MB':>10} {'attn MB':>8} {'ratio':>6}")
    t = {(r["model"], r["seq_length"]): r for r in train}
    for seq, ratio in summary["train_hybrid_over_attention"].items():
        h, a = t[("hybrid", seq)], t[("attention", seq)]
        print(f"{seq:>6} {h['tokens_per_s']:>13.0f} {a['tokens_per_s']:>11.0f} {ratio['tokens_per_s']:>6.2f} "
              f"{h['peak_mem_mb']:>10.0f} {a['peak_mem_mb']:>8.0f} {ratio['peak_mem']:>6.2f}")
    models = sorted({r["model"] for r in decode})
    print("\ndecode CPU ms/token after a prompt of each length (best step)")
    print(f"{'context':>8} " + " ".join(f"{m:>10}" for m in models))
    d = {(r["model"], r["context"]): r for r in decode}
    for seq in sorted({r["context"] for r in decode}):
        print(f"{seq:>8} " + " ".join(f"{d[(m, seq)]['decode_ms_per_token']:>10.2f}" for m in models))
    print("growth   " + " ".join(f"{summary['decode_growth_longest_over_shortest'][m]:>9.2f}x" for m in models))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker is not None:
        name, seq = args.worker.split(":")
        print(json.dumps(train_worker(args, name, int(seq))))
        return 0
    from meshtron.models.accounting import count_parameters

    cfgs = model_configs(args)
    params = {name: count_parameters(cfg, VOCAB) for name, cfg in cfgs.items()}
    for name, cfg in cfgs.items():
        print(f"{name:9s}: pattern {cfg.pattern!r}, ffn {cfg.ffn_size}, {params[name] / 1e6:.3f}M parameters")
    train = run_training(args, argv) if args.train_lengths else []
    decode = run_decoding(args) if args.decode_lengths else []
    summary = summarize(train, decode) if train and decode else {}
    if summary:
        print_tables(train, decode, summary)
    result = {"benchmark": "mamba", "machine": platform.machine(), "python": platform.python_version(),
              "args": {k: v for k, v in vars(args).items() if k not in ("worker", "output")},
              "models": {n: {"pattern": c.pattern, "ffn_hidden_size": c.ffn_size, "parameters": params[n]}
                         for n, c in cfgs.items()},
              "train": train, "decode": decode, "summary": summary}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
