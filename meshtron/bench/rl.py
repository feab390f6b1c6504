"""GRPO throughput on the tiny Countdown recipe: rollout tokens/s, training tokens/s and the share of
a step spent generating, with two baselines measured in the same run on the same rollouts:
  - rollouts: the engine (continuous batching, paged KV cache) against the naive loop (one request
    at a time, contiguous KV cache, `meshtron.inference.simple.generate_tokens`);
  - training: forward + backward of the policy loss over rollouts packed best-fit into rows against
    one rollout per row padded to the longest.
Medians over the measured steps (the first step is a warm-up and not counted, unless it is the only one).

    python benchmarks/rl.py [--config configs/grpo-countdown-tiny.yaml] [--steps 6] [--warmup-steps 60]
                            [--naive-prompts 8] [--output benchmarks/results/rl.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

DEFAULT_OUTPUT = Path("benchmarks/results/rl.json")


def _trainer(args: argparse.Namespace, run_dir: str):
    from meshtron.config.loader import load_config
    from meshtron.rl.trainer import GRPOTrainer

    overrides = {"train.run_dir": run_dir, "train.train_iters": str(args.steps), "rl.warmup_steps": str(args.warmup_steps),
                 "rl.eval_interval": "0", "checkpoint.save_at_end": "false", "logger.progress_bar": "off"}
    if args.threads:
        overrides["train.num_threads"] = str(args.threads)
    return GRPOTrainer(load_config(args.config, overrides))


def _naive_rollouts(trainer, problems, seed: int) -> tuple[float, int]:
    """Seconds and completion tokens of the naive loop on the same prompts and sampling."""
    from meshtron.inference.simple import generate_tokens

    rl, tok = trainer.cfg.rl, trainer.tokenizer
    trainer.model.eval()
    start, tokens = time.perf_counter(), 0
    for i, p in enumerate(problems):
        ids = tok.encode(trainer.env.get_prompt(p))
        for j in range(rl.group_size):
            out = generate_tokens(trainer.model, ids, rl.max_new_tokens, temperature=rl.temperature,
                                  seed=seed + 1000 * i + j, stop_ids=(tok.eod_id,))
            tokens += len(out)
    return time.perf_counter() - start, tokens


def _train_layouts(trainer, rollouts) -> dict[str, float]:
    """Training tokens/s of forward + backward over packed rows and over one padded row per rollout."""
    from meshtron.rl.grpo import forward_log_probs, train_sequences
    from meshtron.rl.loss import PolicyLossConfig, policy_loss
    from meshtron.rl.packing import micro_batches, pack_sequences, unpacked_rows

    rl = trainer.cfg.rl
    seqs = train_sequences(rollouts, rl.aggregation, rl.max_new_tokens)
    num_tokens = sum(len(s.token_ids) - 1 for s in seqs)
    layouts = {"packed": pack_sequences(seqs, rl.pack_length, trainer.tokenizer.pad_id),
               "padded": unpacked_rows(seqs, trainer.tokenizer.pad_id)}
    out = {}
    trainer.model.train()
    for name, rows in layouts.items():
        # the same number of token positions per forward in both layouts
        per_forward = max(1, trainer.cfg.train.micro_batch_size * rl.pack_length // rows[0]["input_ids"].shape[0])
        batches = micro_batches(rows, per_forward)
        start = time.perf_counter()
        for mb in batches:
            logp, _ = forward_log_probs(trainer.model, mb, rl.temperature)
            loss, _ = policy_loss(logp, logp.detach(), mb["advantages"], mb["weights"], PolicyLossConfig())
            loss.backward()
        seconds = time.perf_counter() - start
        trainer.model.zero_grad(set_to_none=True)
        out[name] = num_tokens / seconds
        out[f"{name}_rows"] = len(rows)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from meshtron.rl.rollout import generate_groups
    from meshtron.training.metrics import MetricsLogger

    with tempfile.TemporaryDirectory(prefix="meshtron-bench-rl-") as tmp:
        trainer = _trainer(args, tmp)
        if args.warmup_steps:  # completions of a warmed-up model look like the recipe's (short, well-formed)
            logger = MetricsLogger(trainer.cfg.logger, Path(tmp), args.warmup_steps, enabled=False)
            trainer.warmup(logger)
        steps = [trainer.grpo_step() for _ in range(args.steps)]
        steps = steps[1:] or steps  # one step only: measure it, warm-up included
        rl = trainer.cfg.rl
        problems = [trainer.train_problems[i] for i in range(args.naive_prompts)]
        t0 = time.perf_counter()
        rollouts = generate_groups(trainer.backend, trainer.env, trainer.tokenizer, problems, rl.group_size,
                                   trainer.sampling(), seed=99, step=0)
        engine_s = time.perf_counter() - t0
        engine_tokens = sum(len(r.completion_ids) for r in rollouts)
        naive_s, naive_tokens = _naive_rollouts(trainer, problems, seed=99)
        layouts = _train_layouts(trainer, rollouts)

    def median(key: str) -> float:
        return statistics.median(s[key] for s in steps)

    return {
        "config": args.config, "measured_steps": len(steps),
        "prompts_per_step": rl.prompts_per_step, "group_size": rl.group_size, "max_new_tokens": rl.max_new_tokens,
        "rollout_tokens_per_s": statistics.median(s["rollout_tokens"] / s["rollout_s"] for s in steps),
        "train_tokens_per_s": statistics.median(s["train_tokens"] / s["train_s"] for s in steps),
        "generation_share": median("generation_share"), "step_s": median("rollout_s") + median("train_s"),
        "completion_tokens_mean": median("completion_tokens_mean"),
        "engine_vs_naive_rollouts": {"prompts": len(problems), "engine_tokens_per_s": engine_tokens / engine_s,
                                     "naive_tokens_per_s": naive_tokens / naive_s,
                                     "ratio": (engine_tokens / engine_s) / (naive_tokens / naive_s)},
        "packed_vs_padded_training": {**layouts, "ratio": layouts["packed"] / layouts["padded"]},
        "threads": torch.get_num_threads(), "machine": platform.machine(), "torch": torch.__version__,
    }


def print_table(r: dict[str, Any]) -> None:
    rows = [("rollout tokens/s (engine, in the loop)", f"{r['rollout_tokens_per_s']:.0f}"),
            ("training tokens/s (packed, fwd+bwd+step)", f"{r['train_tokens_per_s']:.0f}"),
            ("share of step time in generation", f"{100 * r['generation_share']:.0f}%"),
            ("step time (s)", f"{r['step_s']:.2f}"),
            ("rollouts: engine / naive loop", f"{r['engine_vs_naive_rollouts']['ratio']:.2f}x "
             f"({r['engine_vs_naive_rollouts']['engine_tokens_per_s']:.0f} vs "
             f"{r['engine_vs_naive_rollouts']['naive_tokens_per_s']:.0f} tok/s)"),
            ("training fwd+bwd: packed / padded rows", f"{r['packed_vs_padded_training']['ratio']:.2f}x "
             f"({r['packed_vs_padded_training']['packed_rows']} vs {r['packed_vs_padded_training']['padded_rows']} rows)")]
    width = max(len(k) for k, _ in rows)
    print(f"GRPO benchmark: {r['config']}, {r['prompts_per_step']} prompts x {r['group_size']} samples, "
          f"median of {r['measured_steps']} steps, {r['threads']} threads")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="benchmarks/rl.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/grpo-countdown-tiny.yaml", help="RL recipe to measure")
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps (the first is not counted unless it is the only one)")
    parser.add_argument("--warmup-steps", type=int, default=60, help="supervised warm-up steps before measuring")
    parser.add_argument("--naive-prompts", type=int, default=8, help="prompts for the engine vs naive comparison")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the recipe's)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: {args.steps} is not allowed; must be >= 1")
    if args.naive_prompts < 1:
        parser.error(f"--naive-prompts: {args.naive_prompts} is not allowed; must be >= 1")
    result = run(args)
    print_table(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0
