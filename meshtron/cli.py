"""The `meshtron` command: parse arguments, build a config, call one function.

    meshtron train --config C [--section.field value ...]
    meshtron generate --checkpoint DIR --prompt "def " [--max-new-tokens --temperature --top-k --top-p --seed]
    meshtron bench train [options]
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from meshtron.config.fields import ConfigError
from meshtron.config.loader import OneLineParser, add_config_arguments, overrides_from_args


def cmd_train(args: argparse.Namespace) -> int:
    from meshtron.config.loader import load_config
    from meshtron.training import Trainer

    cfg = load_config(args.config, overrides_from_args(args))
    Trainer(cfg).train()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    import yaml

    from meshtron.checkpoint import load_checkpoint, read_checkpoint_config
    from meshtron.config.loader import config_from_dict
    from meshtron.data.tokenizer import build_tokenizer
    from meshtron.inference.simple import generate_tokens
    from meshtron.models import GPTModel
    from meshtron.training.trainer import resolve_device

    cfg = config_from_dict(yaml.safe_load(read_checkpoint_config(args.checkpoint)))
    tokenizer = build_tokenizer(cfg.tokenizer)
    device = resolve_device(args.device)
    model = GPTModel(cfg.model, tokenizer.vocab_size).to(device)
    load_checkpoint(args.checkpoint, model)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: {args.max_new_tokens} is not allowed; must be >= 1")
    prompt_ids = tokenizer.encode(args.prompt)
    ids = generate_tokens(model, prompt_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop_ids=(tokenizer.eod_id,))
    torch.set_printoptions()  # nothing else printed by torch
    print(args.prompt + tokenizer.decode(ids))
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from meshtron.bench.train_throughput import main as bench_main

    return bench_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="meshtron", description="Train, serve and post-train LLMs on torch.distributed.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    train = sub.add_parser("train", help="train a model from a config", description="Train a model. Every config "
                           "field is a flag --section.field; values given here override the YAML file.")
    add_config_arguments(train)
    train.set_defaults(func=cmd_train)

    gen = sub.add_parser("generate", help="sample text from a checkpoint")
    gen.add_argument("--checkpoint", required=True, help="checkpoint directory (a step dir or its parent with 'latest')")
    gen.add_argument("--prompt", default="", help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    gen.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 is greedy (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run (default auto)")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=OneLineParser)
    bt = bench_sub.add_parser("train", help="trainer tokens/s and MFU against a plain PyTorch loop", add_help=False)
    bt.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of benchmarks/train_throughput.py")
    bt.set_defaults(func=cmd_bench_train)

    from meshtron.data.commands import register as register_data_commands

    register_data_commands(sub)
    try:
        from meshtron.models.hf.commands import register as register_convert_commands
    except ImportError:
        pass
    else:
        register_convert_commands(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed in one line
        return int(e.code or 0)
    from meshtron.checkpoint import CheckpointError
    from meshtron.training import TrainingError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
