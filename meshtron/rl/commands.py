"""`meshtron rl --config C [--section.field value ...]`: GRPO from a config (see docs/rl.md)."""

from __future__ import annotations

import argparse


def cmd_rl(args: argparse.Namespace) -> int:
    from meshtron.rl.trainer import GRPOTrainer
    from meshtron.training.dry_run import load_for, run_dry_run
    from meshtron.training.run_dir import check_run_dir

    cfg = load_for(args, "rl")
    if args.dry_run:
        return run_dry_run(cfg, "rl", args.world_size)
    check_run_dir(cfg)
    GRPOTrainer(cfg).train()   # writes reward_curve.csv and, with the 'plot' extra, reward_curve.png
    return 0


def register(sub) -> None:
    from meshtron.config.loader import add_config_arguments
    from meshtron.training.dry_run import add_dry_run_arguments

    rl = sub.add_parser("rl", help="reinforcement learning (GRPO) from a config",
                        description="GRPO: rollouts from the in-process engine, verifiable rewards, policy updates. "
                                    "Every config field is a flag --section.field; the rl and env sections hold "
                                    "the RL settings.")
    add_config_arguments(rl, command="rl")
    add_dry_run_arguments(rl)
    rl.set_defaults(func=cmd_rl)
