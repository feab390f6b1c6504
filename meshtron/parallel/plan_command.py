"""The `meshtron plan` verb: print the per-rank memory estimate of a layout from the config alone,
and with --parameters each parameter's tensor-parallel placement and local shape.

    meshtron plan --config C [--world-size N] [--parameters] [--section.field value ...]

`register(subparsers)` adds it to the main CLI. A configuration error prints one line to stderr and
returns 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from meshtron.config.fields import ConfigError
from meshtron.config.loader import add_config_arguments, load_config, overrides_from_args

MIB = 1 << 20
COLUMNS = (("params", "param_bytes"), ("grads", "grad_bytes"), ("optimizer", "optimizer_bytes"),
           ("activations", "activation_bytes"), ("total", "total_bytes"))


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per pipeline rank, sizes in MiB; activations also per micro-batch x in flight."""
    header = f"{'stage':>5}  {'sublayers':<12}" + "".join(f"  {name + ' MiB':>15}" for name, _ in COLUMNS)
    lines = [header + "  activations per micro-batch MiB x in flight"]
    for r in rows:
        sizes = "".join(f"  {r[key] / MIB:>15.2f}" for _, key in COLUMNS)
        lines.append(f"{r['stage']:>5}  {r['sublayers']:<12}{sizes}  "
                     f"{r['activation_bytes_per_microbatch'] / MIB:.2f} x {r['microbatches_in_flight']:g}")
    return "\n".join(lines)


def format_parameters(rows: list[dict[str, Any]]) -> str:
    """One line per parameter: name, shape, tp placement ('-': a plain whole tensor), tp rank 0's shape."""
    width = max(len(r["name"]) for r in rows)
    lines = [f"{'parameter':<{width}}  {'shape':<16}  {'tp placement':<14}  tp rank 0 shape"]
    for r in rows:
        shape, local = "x".join(map(str, r["shape"])), "x".join(map(str, r["tp_local_shape"]))
        lines.append(f"{r['name']:<{width}}  {shape:<16}  {str(r['tp_placement'] or '-'):<14}  {local}")
    return "\n".join(lines)


def describe_layout(cfg, world_size: int) -> str:
    from meshtron.parallel.dims import ParallelDims

    d = ParallelDims.from_config(cfg.parallel, world_size)
    p = cfg.parallel
    extras = [f"sequence parallel {'on' if p.sequence_parallel else 'off'}" if d.tp > 1 else "",
              f"schedule {p.pp_schedule} x {p.pp_virtual_stages} virtual" if d.pp > 1 else "",
              f"recompute {p.activation_checkpoint}" if p.activation_checkpoint != "none" else ""]
    layout = (f"world {world_size} = dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} x tp {d.tp} "
              f"x pp {d.pp}")
    return "; ".join([layout, *[e for e in extras if e]])


def layout_world_size(p) -> int:
    """The processes a layout names: the product of its degrees (dp_shard -1 counts as 1)."""
    return p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp * p.pp


def cmd_plan(args: argparse.Namespace) -> int:
    from meshtron.parallel.plan import estimate_memory, parameter_layout

    try:
        if args.world_size is not None and args.world_size < 1:
            raise ConfigError(f"--world-size: {args.world_size} is not allowed; must be >= 1")
        cfg = load_config(args.config, overrides_from_args(args), validate=False)
        world_size = args.world_size or layout_world_size(cfg.parallel)
        cfg.validate(world_size=world_size)
        rows = estimate_memory(cfg, world_size)
        params = parameter_layout(cfg, world_size) if args.parameters else None
        layout = describe_layout(cfg, world_size)
    except ValueError as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = cfg.train
    print(f"plan: {layout}")
    print(f"micro-batch {t.micro_batch_size} x {cfg.data.seq_length} tokens, global batch {t.global_batch_size}, "
          f"{cfg.optimizer.type}, {t.precision}; parameters per rank: "
          + ", ".join(f"stage {r['stage']} {r['num_params'] / 1e6:.2f}M" for r in rows))
    print(format_table(rows))
    if params is not None:
        print(format_parameters(params))
    return 0


def register(subparsers) -> None:
    """Add `plan` to an argparse subparsers object."""
    plan = subparsers.add_parser("plan", help="estimate per-rank memory of a parallel layout (no allocation)",
                                 description="Estimate parameter, gradient, optimizer-state and activation memory "
                                 "per pipeline rank from the config alone (meta device, nothing allocated).")
    plan.add_argument("--world-size", type=int, default=None,
                      help="number of processes the layout runs on (default: the product of the config's parallel "
                           "degrees, dp_shard -1 counting as 1)")
    plan.add_argument("--parameters", action="store_true",
                      help="also print every parameter's tensor-parallel placement and tp rank 0's local shape")
    add_config_arguments(plan)
    plan.set_defaults(func=cmd_plan)


def main(argv: list[str] | None = None) -> int:
    from meshtron.config.loader import OneLineParser

    parser = OneLineParser(prog="meshtron")
    register(parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
