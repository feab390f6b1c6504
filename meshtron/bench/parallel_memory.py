"""Memory and step time of each parallel layout of a ~50M-parameter model, measured per rank on
gloo ranks and compared with `meshtron plan`'s estimate from the config alone.

Per rank we measure the local parameter bytes (DTensor shards), the gradient bytes just before the
optimizer step, the optimizer-state bytes after the steps, the activation bytes of one micro-batch
(distinct storages autograd saves during a training step after warm-up, divided by the local
micro-batches), and the median time of the steps after that. Every rank runs one thread (the
fork-safe launcher's rule), so on a 2-core machine layouts of 4 ranks share 2 cores.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from meshtron.config.fields import ConfigError
from meshtron.config.loader import OneLineParser, add_config_arguments, config_to_dict, load_config, overrides_from_args

DEFAULT_OUTPUT = Path("benchmarks/results/parallel_memory.json")
MIB = 1 << 20

# 8 layers x 640 wide, 10 heads of 64, SwiGLU MLP of 2560, byte vocabulary padded to 384, 256 tokens:
# 52.9M parameters. Global batch 4 of micro-batches of 1 keeps a step a few seconds on one thread.
MODEL = {
    "model.layer_pattern": "", "model.num_layers": "8", "model.hidden_size": "640",
    "model.num_attention_heads": "10", "model.num_query_groups": "null", "model.kv_channels": "null",
    "model.ffn_hidden_size": "2560", "model.activation": "swiglu", "model.max_position_embeddings": "256",
    "data.seq_length": "256", "train.micro_batch_size": "1", "train.global_batch_size": "4",
    "train.train_iters": "1000", "train.eval_interval": "0", "train.peak_flops": "1e11",
    "train.device": "cpu", "logger.progress_bar": "off", "checkpoint.save_at_end": "false", "checkpoint.load": "null",
}

# name -> (world size, overrides, module the layout needs)
LAYOUTS: dict[str, tuple[int, dict[str, str], Optional[str]]] = {
    "single": (1, {}, None),
    "fsdp2": (2, {"parallel.dp_shard": "2"}, None),
    "fsdp4": (4, {"parallel.dp_shard": "4"}, None),
    "tp2": (2, {"parallel.tp": "2", "parallel.sequence_parallel": "false"}, None),
    "tp2_sp": (2, {"parallel.tp": "2"}, None),
    "hsdp_2x2": (4, {"parallel.dp_replicate": "2", "parallel.dp_shard": "2"}, None),
    "tp2_fsdp2": (4, {"parallel.tp": "2", "parallel.dp_shard": "2"}, None),
    "pp2": (2, {"parallel.pp": "2", "parallel.pp_schedule": "1f1b"}, "meshtron.parallel.pipeline"),
    "pp2_interleaved": (2, {"parallel.pp": "2", "parallel.pp_schedule": "interleaved_1f1b",
                            "parallel.pp_virtual_stages": "2"}, "meshtron.parallel.pipeline"),
    "tp2_pp2": (4, {"parallel.tp": "2", "parallel.pp": "2", "parallel.pp_schedule": "1f1b"},
                "meshtron.parallel.pipeline"),
    "pp2_fsdp2": (4, {"parallel.pp": "2", "parallel.pp_schedule": "1f1b", "parallel.dp_shard": "2"},
                  "meshtron.parallel.pipeline"),
    "cp2": (2, {"parallel.cp": "2"}, "meshtron.parallel.context_parallel"),
}

MEASURED = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes_per_microbatch")


# ---- on every rank ----------------------------------------------------------------------------------

def _nbytes(t) -> int:
    from meshtron.parallel.plan import local_tensor

    local = local_tensor(t)
    return local.numel() * local.element_size()


def _record_grad_bytes(trainer, out: dict[str, int]) -> None:
    """Wrap the optimizer's step to record the gradient bytes it is about to consume."""
    step = trainer.optimizer.step

    def step_and_record(*args, **kwargs):
        out["grad_bytes"] = sum(_nbytes(p.grad) for p in trainer.model.parameters() if p.grad is not None)
        return step(*args, **kwargs)

    trainer.optimizer.step = step_and_record


def measure_layout(rank: int, world_size: int, config: Optional[str], overrides: dict[str, str],
                   warmup: int, steps: int) -> dict[str, Any]:
    """`warmup` untimed steps, one untimed step under the saved-tensor counter (after warm-up: the
    pipeline's first step also runs shape inference), then `steps` timed ones; report bytes and times."""
    import resource

    import torch

    from meshtron.parallel.plan import SavedTensorCounter
    from meshtron.training import Trainer

    trainer = Trainer(load_config(config, overrides, world_size=world_size), echo=False)
    result: dict[str, Any] = {"rank": rank}
    for _ in range(warmup):
        trainer.train_step(trainer.loader.next_global_batch())
    _record_grad_bytes(trainer, result)
    batch = trainer.loader.next_global_batch()
    with SavedTensorCounter(trainer.model) as counter:
        trainer.train_step(batch)
        result["activation_bytes_per_microbatch"] = counter.total // len(batch)
    times = []
    for _ in range(steps):
        batch = trainer.loader.next_global_batch()
        t0 = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - t0)
    result["step_s"] = times
    result["stage"] = trainer.mesh["pp"].get_local_rank() if trainer.mesh is not None else 0
    result["param_bytes"] = sum(_nbytes(p) for p in trainer.model.parameters())
    result["optimizer_bytes"] = sum(_nbytes(v) for state in trainer.optimizer.state.values()
                                    for v in state.values() if isinstance(v, torch.Tensor))
    result["rss_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


# ---- in the parent ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="benchmarks/parallel_memory.py", description="Per-rank parameter, gradient, "
                           "optimizer and activation memory and step time of each parallel layout of a ~50M "
                           "model on gloo ranks, against `meshtron plan`'s estimate.")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per layout (default 3)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps before the measured step and the timed ones (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per layout (default 600)")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help=f"JSON results file (default {DEFAULT_OUTPUT})")
    add_config_arguments(parser)
    return parser


def missing_module(name: Optional[str]) -> Optional[str]:
    if name is None:
        return None
    try:
        importlib.import_module(name)  # imports only: the parent runs no collective and forks nothing
    except ImportError as e:
        return f"skipped: {name} does not import ({e})"
    return None


def by_stage(ranks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The largest value of each measurement over the ranks of each pipeline stage (FSDP's first
    shards are the padded, largest ones), and the step time as the slowest rank's median."""
    stages: dict[int, dict[str, Any]] = {}
    for r in ranks:
        s = stages.setdefault(r["stage"], {k: 0 for k in (*MEASURED, "rss_peak_bytes")})
        for k in s:
            s[k] = max(s[k], r.get(k, 0))
    return stages


def run_layout(name: str, args: argparse.Namespace, base: dict[str, str]) -> dict[str, Any]:
    from meshtron.parallel.plan import estimate_memory
    from meshtron.testing.multiprocess import RankFailure, run_ranks

    world, extra, needs = LAYOUTS[name]
    entry: dict[str, Any] = {"layout": name, "world_size": world, "overrides": extra}
    with tempfile.TemporaryDirectory(prefix=f"parallel-memory-{name}-") as run_dir:
        overrides = {**base, **extra, "train.run_dir": run_dir}
        entry["plan"] = estimate_memory(load_config(args.config, overrides, world_size=world), world)
        entry["note"] = missing_module(needs)
        if entry["note"]:
            return entry
        t0 = time.perf_counter()
        try:
            ranks = run_ranks("meshtron.bench.parallel_memory:measure_layout", world, timeout_s=args.timeout,
                              config=args.config, overrides=overrides, warmup=args.warmup, steps=args.steps)
        except RankFailure as e:
            entry["note"] = "failed: " + str(e).strip().splitlines()[-1][:300]
            return entry
    entry["wall_s"] = time.perf_counter() - t0
    entry["ranks"] = ranks
    entry["measured"] = {str(k): v for k, v in sorted(by_stage(ranks).items())}
    # every step waits for the slowest rank; the median over steps of that is the layout's step time.
    # Load from other processes only slows a step down, so the fastest one is a noise-robust second view.
    slowest = [max(r["step_s"][i] for r in ranks) for i in range(args.steps)]
    entry["step_s"], entry["best_step_s"] = statistics.median(slowest), min(slowest)
    return entry


def print_table(entries: list[dict[str, Any]]) -> None:
    single = next((e for e in entries if e["layout"] == "single" and "step_s" in e), None)
    cols = ("params", "grads", "optimizer", "act/micro-batch")
    print(f"{'layout':<10} {'ranks':>5} {'stage':>5}" + "".join(f"  {c + ' plan/meas MiB':>27}" for c in cols)
          + f"  {'in flight':>9}  {'total plan MiB':>14}  {'step s':>7}  {'x single':>8}  {'best x':>6}")
    for e in entries:
        if e.get("note"):
            print(f"{e['layout']:<10} {e['world_size']:>5}  {e['note']}")
        for plan in e["plan"]:
            meas = e.get("measured", {}).get(str(plan["stage"]))
            pairs = "".join(f"  {plan[k] / MIB:>12.2f} / {meas[k] / MIB if meas else float('nan'):>11.2f}"
                            for k in MEASURED)
            step = (f"{e['step_s']:>7.2f}  {e['step_s'] / single['step_s']:>8.2f}  "
                    f"{e['best_step_s'] / single['best_step_s']:>6.2f}" if single and "step_s" in e else "")
            print(f"{e['layout']:<10} {e['world_size']:>5} {plan['stage']:>5}{pairs}  "
                  f"{plan['microbatches_in_flight']:>9g}  {plan['total_bytes'] / MIB:>14.2f}  {step}")


def quarter_check(entries: list[dict[str, Any]]) -> Optional[str]:
    """FSDP4's parameter + optimizer bytes per rank against the single process's."""
    found = {e["layout"]: e for e in entries if "measured" in e}
    if "single" not in found or "fsdp4" not in found:
        return None

    def state(e, source):
        row = e["measured"]["0"] if source == "measured" else e["plan"][0]
        return row["param_bytes"] + row["optimizer_bytes"]

    ratios = {src: state(found["fsdp4"], src) / state(found["single"], src) for src in ("measured", "plan")}
    return (f"FSDP4 parameter + optimizer bytes per rank / single process: measured {ratios['measured']:.4f}, "
            f"plan {ratios['plan']:.4f} (1/4 = 0.25)")


def environment() -> dict[str, Any]:
    import os

    import torch

    return {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(), "threads_per_rank": 1}


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        raise ConfigError(f"--layouts: {unknown or names} is not allowed; choose from {', '.join(LAYOUTS)}")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(f"--steps/--warmup: {args.steps}/{args.warmup} is not allowed; need steps >= 1, warmup >= 0")
    base = {**MODEL, **overrides_from_args(args)}
    cfg = load_config(args.config, base)
    from meshtron.models.gpt import count_parameters
    from meshtron.parallel.plan import vocab_size

    num_params = count_parameters(cfg.model, vocab_size(cfg))
    print(f"parallel memory: {num_params / 1e6:.1f}M parameters ({cfg.model.num_layers} layers x "
          f"{cfg.model.hidden_size}, {cfg.model.num_attention_heads} heads, ffn {cfg.model.ffn_size} "
          f"{cfg.model.activation}); micro-batch {cfg.train.micro_batch_size} x {cfg.data.seq_length}, global "
          f"batch {cfg.train.global_batch_size}; {args.warmup} warm-up + 1 measured + {args.steps} timed steps; "
          "1 thread per rank")
    entries = []
    for name in names:
        entry = run_layout(name, args, base)
        entries.append(entry)
        status = entry["note"] or f"done in {entry['wall_s']:.0f} s"
        print(f"  {name}: {status}", flush=True)
    print()
    print_table(entries)
    check = quarter_check(entries)
    if check:
        print(check)
    data = {"benchmark": "parallel_memory", "num_params": num_params, "settings": vars(args) | {"model": base},
            "environment": environment(), "config": config_to_dict(cfg), "quarter_check": check, "layouts": entries}
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed in one line
        return int(e.code or 0)
    try:
        return run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
