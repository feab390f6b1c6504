"""Optimizer CPU offload: step time and memory of a ~100M-parameter model with a fraction of the
Adam states on the host (0 = the plain device optimizer, the baseline of the same run).

Each fraction runs in a fresh process (so its peak memory is its own): `warmup` untimed optimizer
steps, then `steps` timed ones; we report the medians of the step time and of its optimizer phase,
the optimizer-state bytes on the device and on the host (plus the host copies and gradient buffers
offload adds), the process's peak resident memory and, on CUDA, the peak device memory. On a CPU
the "device" is the host too: offload then only adds copies, and the table shows that cost.

    python benchmarks/offload.py [--fractions 0,0.5,1] [--steps 3] [--warmup 1] [--section.field V ...]
    meshtron bench offload [the same options]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from meshtron.config.fields import ConfigError
from meshtron.config.loader import OneLineParser, add_config_arguments, load_config, overrides_from_args

DEFAULT_OUTPUT = Path("benchmarks/results/offload.json")
MIB = 1 << 20

# 10 layers x 768 wide, 12 heads, SwiGLU MLP of 3072, byte vocabulary: 94.9M parameters.
# One sequence of 128 tokens per step keeps a CPU step at a few seconds.
MODEL = {
    "model.layer_pattern": "", "model.num_layers": "10", "model.hidden_size": "768",
    "model.num_attention_heads": "12", "model.num_query_groups": "null", "model.kv_channels": "null",
    "model.ffn_hidden_size": "3072", "model.activation": "swiglu", "model.max_position_embeddings": "128",
    "data.seq_length": "128", "train.micro_batch_size": "1", "train.global_batch_size": "1",
    "train.train_iters": "1000", "train.eval_interval": "0", "train.peak_flops": "1e11",
    "logger.progress_bar": "off", "checkpoint.save_at_end": "false", "optimizer.type": "adam",
}


def measure(fraction: float, overrides: dict[str, str], config: str | None, warmup: int, steps: int) -> dict[str, Any]:
    """In the worker process: train `warmup + steps` steps with this offload fraction and measure."""
    import resource

    import torch

    from meshtron.training import Trainer
    from meshtron.training.offload import OffloadOptimizer

    cfg = load_config(config, {**overrides, "optimizer.offload_fraction": str(fraction)})
    trainer = Trainer(cfg, echo=False)
    cuda = trainer.device.type == "cuda"
    step_s, optimizer_s = [], []
    for i in range(warmup + steps):
        batch = trainer.loader.next_global_batch()
        t0 = time.perf_counter()
        trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        phases = trainer.timers.end_step(i)
        if i >= warmup:
            step_s.append(elapsed)
            optimizer_s.append(phases.get("optimizer", 0.0))
    opt = trainer.optimizer
    if isinstance(opt, OffloadOptimizer):
        states = opt.state_bytes()
    else:
        states = {"device": sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                                if torch.is_tensor(v) and v.dim() > 0), "host": 0, "host_buffers": 0}
    return {
        "fraction": fraction, "device": trainer.device.type,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "step_s": step_s, "optimizer_s": optimizer_s,
        "step_s_median": statistics.median(step_s), "optimizer_s_median": statistics.median(optimizer_s),
        "device_state_bytes": states["device"], "host_state_bytes": states["host"],
        "host_buffer_bytes": states["host_buffers"],
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="benchmarks/offload.py", description="Step time and memory of a ~100M model with "
                           "a fraction of the optimizer states offloaded to the CPU, against the device optimizer.")
    parser.add_argument("--fractions", default="0,0.5,1", help="comma-separated offload fractions; 0 is the baseline "
                        "(default 0,0.5,1)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per fraction (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help=f"JSON results file (default {DEFAULT_OUTPUT})")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one fraction, JSON on stdout
    add_config_arguments(parser)
    return parser


def run_fraction(fraction: float, argv: list[str]) -> dict[str, Any]:
    """One fraction in a fresh interpreter (its own peak memory)."""
    proc = subprocess.run([sys.executable, "-m", "meshtron.bench.offload", "--worker", str(fraction), *argv],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"fraction": fraction, "note": "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(entries: list[dict[str, Any]]) -> None:
    base = next((e for e in entries if e.get("fraction") == 0 and "step_s_median" in e), None)
    print(f"{'fraction':>8}  {'step s':>7}  {'x base':>6}  {'optim s':>7}  {'x base':>6}  {'device state MiB':>16}  "
          f"{'host state MiB':>14}  {'host copies MiB':>15}  {'peak RSS MiB':>12}  {'cuda peak MiB':>13}")
    for e in entries:
        if "note" in e:
            print(f"{e['fraction']:>8g}  {e['note']}")
            continue
        ratio = (f"{e['step_s_median'] / base['step_s_median']:>6.2f}  {e['optimizer_s_median']:>7.3f}  "
                 f"{e['optimizer_s_median'] / base['optimizer_s_median']:>6.2f}") if base else ""
        cuda = f"{e['cuda_peak_bytes'] / MIB:>13.1f}" if e["cuda_peak_bytes"] is not None else f"{'-':>13}"
        print(f"{e['fraction']:>8g}  {e['step_s_median']:>7.3f}  {ratio}  {e['device_state_bytes'] / MIB:>16.1f}  "
              f"{e['host_state_bytes'] / MIB:>14.1f}  {e['host_buffer_bytes'] / MIB:>15.1f}  "
              f"{e['rss_peak_bytes'] / MIB:>12.1f}  {cuda}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:  # `meshtron bench offload -- --flags`: argparse's REMAINDER keeps the separator
        argv = argv[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed in one line
        return int(e.code or 0)
    overrides = {**MODEL, **overrides_from_args(args)}
    try:
        load_config(args.config, overrides)  # a bad flag fails here, once, in one line
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.worker is not None:
        print(json.dumps(measure(float(args.worker), overrides, args.config, args.warmup, args.steps)))
        return 0
    passthrough = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    passthrough += ["--config", args.config] if args.config else []
    passthrough += [x for k, v in overrides_from_args(args).items() for x in (f"--{k}", v)]
    entries = [run_fraction(f, passthrough) for f in fractions]
    print_table(entries)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "offload", "machine": platform.machine(), "python": platform.python_version(),
                               "overrides": overrides, "results": entries}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
