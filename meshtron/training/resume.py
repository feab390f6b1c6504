"""Which checkpoint a run starts from. `checkpoint.load: auto` resumes from the run's own save
directory when it holds a complete checkpoint and starts fresh otherwise, so a job restarted by
`torchrun --max-restarts`, a SLURM requeue or a Kubernetes restart re-runs the same command. Every
rank must decide the same: the ranks compare their answers before anything is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from meshtron.checkpoint import CheckpointError
from meshtron.checkpoint.manager import MANIFEST, STEP_DIR
from meshtron.config.fields import ConfigError
from meshtron.config.schema import AUTO_LOAD, RunConfig

NOTHING = -1      # no checkpoint: start fresh
UNREADABLE = -2   # a `latest` that names no step directory: the loader reports it


def save_dir(cfg: RunConfig) -> Path:
    """Where the run writes its checkpoints (`checkpoint.save`, by default <run_dir>/checkpoints)."""
    return Path(cfg.checkpoint.save) if cfg.checkpoint.save else Path(cfg.train.run_dir) / "checkpoints"


def find_resume_point(directory: Path) -> tuple[Optional[Path], int]:
    """(what to load, its step) for `checkpoint.load: auto`: the directory itself when its `latest`
    pointer exists (the loader follows and verifies it, so a broken pointer is an error, never a silent
    fresh start), else the newest step directory holding a manifest (a crash after the rename but
    before `latest` was replaced), else (None, NOTHING). `.tmp-*` directories of interrupted saves are
    never complete checkpoints."""
    latest = directory / "latest"
    if latest.is_file():
        try:
            name = latest.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return directory, UNREADABLE
        match = STEP_DIR.match(name)
        return directory, int(match.group(1)) if match else UNREADABLE
    if not directory.is_dir():
        return None, NOTHING
    complete = [(int(m.group(1)), p) for p in directory.iterdir()
                if (m := STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()]
    if not complete:
        return None, NOTHING
    step, path = max(complete)
    return path, step


def _agree(step: int, directory: Path, device: torch.device) -> None:
    """Fail on every rank alike unless all ranks found the same checkpoint (e.g. a save directory on a
    node-local disk, or a network filesystem that has not yet shown one node the newest `latest`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    both = torch.tensor([step, -step], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = int(both[0]), -int(both[1])
    if high != low:
        def say(s: int) -> str:
            return "none" if s == NOTHING else "an unreadable 'latest'" if s == UNREADABLE else f"step {s}"
        raise CheckpointError(f"checkpoint.load: auto: the ranks see different checkpoints in {str(directory)!r} "
                              f"({say(low)} to {say(high)}); put checkpoint.save on a filesystem every node shares")


def resolve_load(cfg: RunConfig, device: torch.device) -> Optional[Path]:
    """The checkpoint to load at start-up, or None to start fresh. A collective when `load` is auto
    under several processes: every rank must call it."""
    load = cfg.checkpoint.load
    if load != AUTO_LOAD:
        return Path(load) if load else None
    directory = save_dir(cfg)
    if directory.is_file():
        raise ConfigError(f"checkpoint.save: {str(directory)!r} is a file; checkpoint.load auto needs a directory")
    path, step = find_resume_point(directory)
    _agree(step, directory, device)
    return path
