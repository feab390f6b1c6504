"""The flags of `meshtron serve` for pipeline-parallel serving (no torch import: the CLI builds its parser
with these)."""

from __future__ import annotations

import argparse
from typing import Optional

from meshtron.config.fields import ConfigError

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pipeline and tensor parallelism under torchrun (docs/serving.md#pipeline-parallel-serving)")
    group.add_argument("--pp", type=int, default=1, metavar="N",
                       help="pipeline stages: the model's layers split into N stages over the torchrun processes, "
                            "served from tp rank 0 of the last stage (default 1)")
    group.add_argument("--tp", type=int, default=None, metavar="N",
                       help="tensor-parallel ranks of each stage (default: the processes divided by --pp); "
                            "pp x tp must equal the number of processes")


def parallel_degrees(pp: int, tp: Optional[int], world_size: int) -> tuple[int, int]:
    """(pp, tp) for `world_size` processes; ConfigError naming the flag when they do not fit."""
    if pp < 1:
        raise ConfigError(f"--pp: {pp} is not allowed; must be >= 1")
    if tp is not None and tp < 1:
        raise ConfigError(f"--tp: {tp} is not allowed; must be >= 1")
    if pp > 1 and world_size == 1:
        raise ConfigError(f"--pp: {pp} stages need {pp} processes or more; start the server with torchrun "
                          f"--nproc-per-node {pp * (tp or 1)} -m meshtron serve ...")
    tp = tp if tp is not None else max(1, world_size // pp)
    if pp * tp != world_size:
        raise ConfigError(f"--pp/--tp: pp ({pp}) x tp ({tp}) = {pp * tp} must equal the number of processes "
                          f"({world_size}); change --pp/--tp or torchrun's --nproc-per-node")
    return pp, tp
