"""The `convert` verb of the `meshtron` command line:

    meshtron convert hf-to-meshtron --hf-dir DIR --output CKPT
    meshtron convert meshtron-to-hf --checkpoint CKPT --output DIR [--architecture A] [--dtype D] [--max-shard-size S]

`register(subparsers)` adds it to the main CLI. Handlers return an exit code; a model that cannot
be converted prints one line to stderr and returns 2.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


def exit_2_on(errors: Callable[[], tuple[type[BaseException], ...]]):
    """Decorator for a command handler: the user errors `errors()` names (imported only when one is
    raised, so the CLI starts fast) print one line and exit 2."""
    def wrap(handler):
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            try:
                return handler(args)
            except errors() as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        return run
    return wrap


def _conversion_errors() -> tuple[type[BaseException], ...]:
    from meshtron.config.fields import ConfigError
    from meshtron.models.hf.adapter import ConversionError
    from meshtron.models.hf.safetensors_io import SafetensorsError

    return ConversionError, SafetensorsError, ConfigError


_user_errors = exit_2_on(_conversion_errors)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give e.g. 5GB, 500MB or a byte count")
    unit = m.group(2).rstrip("b")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
    return int(float(m.group(1)) * scale)


@_user_errors
def cmd_hf_to_meshtron(args: argparse.Namespace) -> int:
    from meshtron.models.hf.convert import hf_to_meshtron

    step_dir = hf_to_meshtron(args.hf_dir, args.output)
    print(f"wrote {step_dir} (load with --checkpoint {args.output}; config {step_dir / 'config.yaml'})")
    return 0


@_user_errors
def cmd_meshtron_to_hf(args: argparse.Namespace) -> int:
    from meshtron.models.hf.convert import meshtron_to_hf

    notes = meshtron_to_hf(args.checkpoint, args.output, architecture=args.architecture, dtype=args.dtype,
                           max_shard_bytes=args.max_shard_size)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {args.output} (config.json, sharded safetensors and index)")
    return 0


def register(subparsers):
    """Add `convert hf-to-meshtron` and `convert meshtron-to-hf` to an argparse subparsers object; return the
    `convert` group's own subparsers, where other converters (models.megatron.commands) add their verbs."""
    convert = subparsers.add_parser("convert", help="convert checkpoints to and from Hugging Face safetensors and Megatron torch_dist")
    # nested parsers of the same class, so usage errors stay one line like the rest of the CLI
    convert_sub = convert.add_subparsers(dest="convert_command", required=True, parser_class=type(convert))

    to_ours = convert_sub.add_parser("hf-to-meshtron", help="a Hugging Face model directory -> a meshtron checkpoint")
    to_ours.add_argument("--hf-dir", required=True, metavar="DIR", help="directory with config.json and safetensors")
    to_ours.add_argument("--output", required=True, metavar="CKPT", help="checkpoint directory to write (step 0)")
    to_ours.set_defaults(func=cmd_hf_to_meshtron)

    to_hf = convert_sub.add_parser("meshtron-to-hf", help="a meshtron checkpoint -> a Hugging Face model directory")
    to_hf.add_argument("--checkpoint", required=True, metavar="CKPT", help="a step dir or its parent with 'latest'")
    to_hf.add_argument("--output", required=True, metavar="DIR", help="directory for config.json and safetensors")
    to_hf.add_argument("--architecture", default=None, help="a family name (llama, mistral, qwen2, qwen3, gpt2, "
                       "mamba2, nemotron_h, mixtral, qwen3_moe, deepseek_v3, gpt_oss) or its architecture "
                       "(default: the checkpoint's Hugging Face origin, else guessed from the model config)")
    to_hf.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"),
                       help="tensor dtype (default: the origin's dtype, else fp32)")
    to_hf.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE",
                       help="largest shard, e.g. 5GB or 500MB (default 5GB)")
    to_hf.set_defaults(func=cmd_meshtron_to_hf)
    return convert_sub
