"""Config verbs of the `meshtron` command line.

    meshtron config docs [--output docs/config.md] [--check]    the reference generated from the dataclasses
    meshtron config show --config C [--section.field v ...]     the resolved config and its difference from the defaults
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from meshtron.config.fields import ConfigError
from meshtron.config.loader import OneLineParser, add_config_arguments, config_to_dict, load_config, overrides_from_args
from meshtron.config.reference import Section, config_diff, render_reference, run_sections, yaml_value

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

DEFAULT_OUTPUT = "docs/config.md"


def cmd_config_docs(args: argparse.Namespace, sections: list[Section]) -> int:
    text = render_reference(sections)
    path = Path(args.output)
    if args.check:
        current = path.read_text() if path.is_file() else None
        if current != text:
            state = "missing" if current is None else "out of date"
            print(f"error: {path} is {state}; run `meshtron config docs` and commit the result", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path} ({sum(1 for line in text.splitlines() if line.startswith('| `'))} fields)")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    overrides = overrides_from_args(args)
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(args.config, overrides, world_size=world_size)
    if not args.diff:
        source = " + ".join(filter(None, [args.config, f"{len(overrides)} flag(s)" if overrides else ""]))
        print(f"# resolved config ({source or 'defaults'})")
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False).rstrip())
        print()
    diff = config_diff(cfg)
    print(f"# differences from the defaults: {len(diff)} field(s)")
    for key, default, value in diff:
        origin = f"--{key}" if key in overrides else args.config
        print(f"{key}: {yaml_value(default)} -> {yaml_value(value)}    ({origin})")
    return 0


def _run(handler: Any, *extra: Any):
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args, *extra)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return run


def register(sub: Any, extra_sections: tuple[Section, ...] = ()) -> None:
    """Add `config docs` and `config show`; `extra_sections` are documented after the RunConfig sections."""
    cfg = sub.add_parser("config", help="configuration reference and the resolved config of a run")
    verbs = cfg.add_subparsers(dest="config_command", required=True, parser_class=OneLineParser)

    docs = verbs.add_parser("docs", help=f"write the configuration reference ({DEFAULT_OUTPUT})",
                            description="Generate the configuration reference from the config dataclasses.")
    docs.add_argument("--output", default=DEFAULT_OUTPUT, help=f"file to write (default {DEFAULT_OUTPUT})")
    docs.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file differs")
    docs.set_defaults(func=_run(cmd_config_docs, [*run_sections(), *extra_sections]))

    show = verbs.add_parser("show", help="print the resolved config and its difference from the defaults",
                            description="Resolve defaults < --config file < --section.field flags, validate, and "
                                        "print the result and every field that differs from the defaults.")
    show.add_argument("--diff", action="store_true", help="print only the difference from the defaults")
    show.add_argument("--world-size", type=int, default=None,
                      help="number of processes the parallel layout is checked against (default $WORLD_SIZE or 1)")
    add_config_arguments(show)
    show.set_defaults(func=_run(cmd_config_show))
