"""Training throughput: tokens/s and MFU of meshtron's `Trainer` against a plain PyTorch loop.

The baseline (`plain_gpt.py`) is the same model shape written by hand with a minimal loop. It starts
from meshtron's weights and trains on the same batches in the same process. Repeats alternate which
loop goes first; we report medians and the median per-repeat ratio meshtron / plain (goal >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from meshtron.bench.plain_gpt import PlainLoop, build_plain, check_plain_supports, token_loss
from meshtron.config.fields import ConfigError
from meshtron.config.loader import OneLineParser, add_config_arguments, config_to_dict, load_config, overrides_from_args
from meshtron.config.schema import RunConfig
from meshtron.models import flops_per_token
from meshtron.training import Trainer, TrainingError
from meshtron.training.flops import resolve_peak_flops
from meshtron.training.precision import resolve_precision
from meshtron.training.trainer import resolve_device

REPO_ROOT = Path(__file__).resolve().parents[2]
# The make-run model shape read by the byte tokenizer, so the benchmark needs no data preparation
# (configs/tiny.yaml trains the same shape on the BPE dataset that `make run` builds first).
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny-bytes.yaml"
DEFAULT_OUTPUT = Path("benchmarks/results/train_throughput.json")
GOAL_RATIO = 0.95

# Dotted overrides applied on top of the YAML file (and below the user's own --section.field flags).
# gpt2-124m keeps meshtron's RMSNorm and RoPE but uses GPT-2's MLP (GELU, 4x width, two matrices)
# and tied embeddings, so it has GPT-2's 124M parameters less its 0.8M learned positions.
PRESETS: dict[str, dict[str, str]] = {
    "tiny": {},
    "gpt2-124m": {
        "model.layer_pattern": "", "model.num_layers": "12", "model.hidden_size": "768",
        "model.num_attention_heads": "12", "model.num_query_groups": "null", "model.kv_channels": "null",
        "model.ffn_hidden_size": "3072", "model.activation": "gelu", "model.vocab_size": "50304",
        "model.max_position_embeddings": "1024", "model.tie_word_embeddings": "true",
        "data.seq_length": "1024", "train.micro_batch_size": "16", "train.global_batch_size": "16",
    },
}


# ---- configuration ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="meshtron bench train", description="Tokens/s and MFU of meshtron's trainer "
                           "against a plain PyTorch loop for the same model, same batches, same process.")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny",
                        help="model shape on top of --config: tiny (the YAML as is) or gpt2-124m "
                             "(12 x 768, 12 heads, ffn 3072 GELU, tied, seq 1024, vocab 50304)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per run (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each run (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each loop, alternating (default 5)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                        help="overrides train.device (default: train.device, auto unless set)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                        help="overrides train.precision (default: bf16 on CUDA unless --train.precision is given, else the config's)")
    parser.add_argument("--peak-flops", type=float, default=None,
                        help="peak FLOP/s for MFU, e.g. 989e12 for H100/H200 dense bf16 (default: measure a matmul)")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help=f"JSON results file (default {DEFAULT_OUTPUT})")
    add_config_arguments(parser)
    parser.set_defaults(config=str(DEFAULT_CONFIG))
    return parser


def check_counts(args: argparse.Namespace) -> None:
    for name, low in (("steps", 1), ("warmup", 0), ("repeats", 1)):
        if getattr(args, name) < low:
            raise ConfigError(f"--{name}: {getattr(args, name)} is not allowed; must be >= {low}")
    if args.peak_flops is not None and args.peak_flops <= 0:
        raise ConfigError(f"--peak-flops: {args.peak_flops} is not allowed; must be > 0")


def build_config(args: argparse.Namespace) -> RunConfig:
    """YAML < preset < --section.field flags < --device/--precision. Never resumes a checkpoint."""
    overrides = {**PRESETS[args.preset], **overrides_from_args(args), "checkpoint.load": "null"}
    if args.device:
        overrides["train.device"] = args.device
    if args.precision:
        overrides["train.precision"] = args.precision
    cfg = load_config(args.config, overrides)
    cfg.train.device = resolve_device(cfg.train.device).type  # 'auto' resolved once, for both loops
    if "train.precision" not in overrides and cfg.train.device == "cuda":
        cfg.train.precision = "bf16"
    return cfg


def resolve_peak(cfg: RunConfig, device: torch.device, given: Optional[float]) -> tuple[float, str]:
    """Peak FLOP/s and where it came from: given, a known GPU's datasheet peak of the precision, else a
    measured matmul (fp32 on a CPU), as the trainer does (training/flops.py)."""
    if given:
        return given, "given (--peak-flops)"
    return resolve_peak_flops(None, device, resolve_precision(cfg.train.precision, device))


# ---- measurement ------------------------------------------------------------------------------

@dataclass
class Run:
    repeat: int
    impl: str  # "meshtron" or "plain"
    position: int  # 0 when this loop ran first in its repeat
    seconds: float  # wall time of the timed steps
    cpu_seconds: float  # CPU time of all this process's threads over the same steps
    tokens_per_s: float
    mfu: float
    step_ms: float
    data_ms: float  # meshtron's loader per step, inside step_ms; the plain loop replays batches drawn beforehand
    last_loss: float
    peak_memory_gb: Optional[float]  # CUDA only


@dataclass
class Setup:
    trainer: Trainer
    plain: PlainLoop
    device: torch.device
    num_warmup: int
    num_steps: int
    tokens_per_step: int
    flops_per_token: float
    peak_flops: float


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step: Callable[[int], Any], num_warmup: int, num_steps: int,
                device: torch.device) -> tuple[tuple[float, float], Any]:
    """Run `step(i)` for the warm-up then the timed steps; return ((wall, CPU) seconds of the timed ones,
    last output). With one thread, CPU time hardly grows when other processes share the cores; wall
    time does (with several, OpenMP threads spin while they wait for each other, so both grow)."""
    out = None
    for i in range(num_warmup):
        out = step(i)
    synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(num_warmup, num_warmup + num_steps):
        out = step(i)
    synchronize(device)
    return (time.perf_counter() - t0, time.process_time() - c0), out


def peek_batches(trainer: Trainer, count: int) -> list[list[dict[str, torch.Tensor]]]:
    """The next `count` global batches, leaving the loader where it was (meshtron draws them again)."""
    state = trainer.loader.state_dict()
    batches = [trainer.loader.next_global_batch() for _ in range(count)]
    trainer.loader.load_state_dict(state)
    return batches


def run_meshtron(s: Setup) -> tuple[tuple[float, float], float, float]:
    """((wall, CPU) seconds, data seconds, last loss) of `trainer.train_step(trainer.loader.next_global_batch())`."""
    data_times: list[float] = []

    def step(i: int) -> float:
        t0 = time.perf_counter()
        batch = s.trainer.loader.next_global_batch()
        data_times.append(time.perf_counter() - t0)
        return s.trainer.train_step(batch).loss

    times, loss = timed_steps(step, s.num_warmup, s.num_steps, s.device)
    return times, sum(data_times[s.num_warmup:]), loss


def run_plain(s: Setup, batches: list) -> tuple[tuple[float, float], float, float]:
    times, loss = timed_steps(lambda i: s.plain.train_step(batches[i]), s.num_warmup, s.num_steps, s.device)
    return times, 0.0, float(loss)


def run_repeat(s: Setup, repeat: int) -> list[Run]:
    batches = peek_batches(s.trainer, s.num_warmup + s.num_steps)
    order = ("meshtron", "plain") if repeat % 2 == 0 else ("plain", "meshtron")  # cancels drift and cache effects
    runs = []
    for position, impl in enumerate(order):
        if s.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(s.device)
        (seconds, cpu_seconds), data_s, loss = run_meshtron(s) if impl == "meshtron" else run_plain(s, batches)
        tokens_per_s = s.tokens_per_step * s.num_steps / seconds
        memory = torch.cuda.max_memory_allocated(s.device) / 2**30 if s.device.type == "cuda" else None
        runs.append(Run(repeat, impl, position, seconds, cpu_seconds, tokens_per_s, s.flops_per_token * tokens_per_s / s.peak_flops,
                        1e3 * seconds / s.num_steps, 1e3 * data_s / s.num_steps, loss, memory))
    return runs


@torch.no_grad()
def initial_losses(s: Setup) -> dict[str, float]:
    """Loss of both models on the first batch before any step: equal unless the baseline is wired differently."""
    mb = peek_batches(s.trainer, 1)[0][0]
    num_tokens = float(mb["loss_mask"].sum())
    losses = {name: float(token_loss(model, mb, s.device, s.plain.autocast, num_tokens))
              for name, model in (("meshtron", s.trainer.model), ("plain", s.plain.model))}
    tolerance = 2e-2 if s.trainer.cfg.train.precision == "bf16" else 1e-4  # relative
    assert abs(losses["meshtron"] - losses["plain"]) <= tolerance * abs(losses["meshtron"]), \
        f"initial losses differ beyond {tolerance}: {losses}; the baseline does not compute meshtron's function"
    return losses


# ---- report -----------------------------------------------------------------------------------

def summarize(runs: list[Run]) -> dict[str, Any]:
    medians = {impl: {k: statistics.median(getattr(r, k) for r in runs if r.impl == impl)
                      for k in ("tokens_per_s", "mfu", "step_ms", "data_ms")} for impl in ("meshtron", "plain")}
    pairs: dict[int, dict[str, Run]] = {r.repeat: {} for r in runs}
    for r in runs:
        pairs[r.repeat][r.impl] = r
    ratios = [p["meshtron"].tokens_per_s / p["plain"].tokens_per_s for p in pairs.values()]
    cpu_ratios = [p["plain"].cpu_seconds / p["meshtron"].cpu_seconds for p in pairs.values()]  # same tokens each
    median_ratio = statistics.median(ratios)
    # Load from other processes only ever slows a run down, so the best run of each is a second,
    # noise-robust view next to the medians.
    best = {impl: max(r.tokens_per_s for r in runs if r.impl == impl) for impl in ("meshtron", "plain")}
    return {"median": medians, "best_tokens_per_s": best, "ratio": {
        "per_repeat": ratios, "median": median_ratio, "goal": GOAL_RATIO, "meets_goal": median_ratio >= GOAL_RATIO,
        "of_medians": medians["meshtron"]["tokens_per_s"] / medians["plain"]["tokens_per_s"],
        "of_best": best["meshtron"] / best["plain"],
        "cpu_time_per_repeat": cpu_ratios, "cpu_time_median": statistics.median(cpu_ratios)}}


def environment(device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return {"torch": torch.__version__, "python": platform.python_version(), "device": device.type,
            "device_name": name, "num_threads": torch.get_num_threads()}


def print_table(s: Setup, args: argparse.Namespace, runs: list[Run], summary: dict[str, Any],
                header: dict[str, Any]) -> None:
    cfg, m = s.trainer.cfg, s.trainer.cfg.model
    t = cfg.train
    print(f"train throughput: preset {args.preset}, config {args.config}")
    print(f"model   {header['num_params']['meshtron'] / 1e6:.2f}M params in both loops: {m.num_layers} layers x "
          f"{m.hidden_size}, {m.num_attention_heads} heads / {m.num_kv_heads} kv, ffn {m.ffn_size} {m.activation}, "
          f"vocab {s.trainer.model.vocab_size}{', tied' if m.tie_word_embeddings else ''}")
    print(f"run     {s.device.type} {t.precision}, {t.global_batch_size} x {cfg.data.seq_length} = {s.tokens_per_step} "
          f"tokens/step, {args.repeats} repeats x {s.num_steps} steps (+{s.num_warmup} warm-up), "
          f"{torch.get_num_threads()} threads")
    print(f"peak    {s.peak_flops / 1e9:,.1f} GFLOP/s ({header['peak_source']}); "
          f"{s.flops_per_token / 1e6:,.2f} MFLOP/token")
    print(f"initial loss  meshtron {header['initial_loss']['meshtron']:.5f}  plain {header['initial_loss']['plain']:.5f}")
    print()
    print(f"{'repeat':>6}  {'first':<8}  {'meshtron tok/s':>14}  {'plain tok/s':>12}  {'ratio':>6}")
    for repeat, ratio in enumerate(summary["ratio"]["per_repeat"]):
        pair = {r.impl: r for r in runs if r.repeat == repeat}
        first = next(r.impl for r in pair.values() if r.position == 0)
        print(f"{repeat:>6}  {first:<8}  {pair['meshtron'].tokens_per_s:>14,.0f}  {pair['plain'].tokens_per_s:>12,.0f}"
              f"  {ratio:>6.3f}")
    med, ratio = summary["median"], summary["ratio"]
    verdict = "met" if ratio["meets_goal"] else "NOT met"
    print(f"{'median':>6}  {'':<8}  {med['meshtron']['tokens_per_s']:>14,.0f}  {med['plain']['tokens_per_s']:>12,.0f}"
          f"  {ratio['median']:>6.3f}  (goal >= {GOAL_RATIO}: {verdict})")
    best = summary["best_tokens_per_s"]
    print(f"{'best':>6}  {'':<8}  {best['meshtron']:>14,.0f}  {best['plain']:>12,.0f}  {ratio['of_best']:>6.3f}")
    if s.device.type == "cpu":
        print(f"{'cpu-time':>6}  {'':<8}  {'':>14}  {'':>12}  {ratio['cpu_time_median']:>6.3f}"
              "  (median ratio of CPU seconds; steady under other load with --train.num_threads 1)")
    print(f"{'MFU':>6}  {'':<8}  {100 * med['meshtron']['mfu']:>13.2f}%  {100 * med['plain']['mfu']:>11.2f}%")
    print(f"{'ms/step':>6}  {'':<8}  {med['meshtron']['step_ms']:>14.1f}  {med['plain']['step_ms']:>12.1f}"
          f"  (meshtron loader {med['meshtron']['data_ms']:.2f} ms/step)")


def write_json(path: Path, s: Setup, args: argparse.Namespace, runs: list[Run], summary: dict[str, Any],
               header: dict[str, Any]) -> None:
    settings = {"preset": args.preset, "config_file": args.config, "steps": s.num_steps, "warmup": s.num_warmup,
                "repeats": args.repeats, "tokens_per_step": s.tokens_per_step,
                "flops_per_token": s.flops_per_token, "peak_flops": s.peak_flops}
    data = {"benchmark": "train_throughput", "settings": settings, **header, "environment": environment(s.device),
            "config": config_to_dict(s.trainer.cfg), "runs": [asdict(r) for r in runs], **summary}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


# ---- entry point ------------------------------------------------------------------------------

def build_setup(args: argparse.Namespace) -> tuple[Setup, dict[str, Any]]:
    cfg = build_config(args)
    check_plain_supports(cfg)  # before the slow start-up
    device = torch.device(cfg.train.device)
    if device.type == "cpu" and cfg.train.precision == "bf16":
        print("warning: bf16 on CPU runs matmuls ~400x slower than fp32; MFU is against the fp32 peak",
              file=sys.stderr)
    if cfg.train.num_threads is not None:  # measure the peak with the threads the steps will use
        torch.set_num_threads(cfg.train.num_threads)
    peak, peak_source = resolve_peak(cfg, device, args.peak_flops)
    cfg.train.peak_flops = peak  # the trainer must not measure again
    trainer = Trainer(cfg, echo=False)
    plain = build_plain(trainer.model, cfg, device)
    vocab = trainer.tokenizer.vocab_size
    s = Setup(trainer, plain, device, args.warmup, args.steps,
              tokens_per_step=cfg.train.global_batch_size * cfg.data.seq_length,
              flops_per_token=flops_per_token(cfg.model, vocab, cfg.data.seq_length), peak_flops=peak)
    num_params = {name: sum(p.numel() for p in model.parameters())
                  for name, model in (("meshtron", trainer.model), ("plain", plain.model))}
    header = {"num_params": num_params, "peak_source": peak_source, "initial_loss": initial_losses(s)}
    return s, header


def run(args: argparse.Namespace) -> int:
    check_counts(args)
    s, header = build_setup(args)
    runs = [r for repeat in range(args.repeats) for r in run_repeat(s, repeat)]
    summary = summarize(runs)
    print_table(s, args, runs, summary, header)
    write_json(Path(args.output), s, args, runs, summary, header)
    print(f"\nwrote {args.output}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    if argv and argv[0] == "--":  # `meshtron bench train -- --flags`: argparse's REMAINDER keeps the separator
        argv = argv[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed in one line
        return int(e.code or 0)
    try:
        return run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
