"""What a run directory already holds, and the rule for starting a command in it: a run directory
holds one run. Re-running into one that holds a run (its config.yaml, metrics.jsonl or checkpoints)
resumes it when the command asks to (`checkpoint.load auto`, or a checkpoint path) and is refused
otherwise, so a repeated command never restarts from step 0 over the old run's files."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from meshtron.checkpoint.manager import STEP_DIR
from meshtron.config.fields import ConfigError
from meshtron.config.schema import RunConfig
from meshtron.training.resume import save_dir

RUN_FILES = ("config.yaml", "metrics.jsonl")


def save_interval(cfg: RunConfig) -> int:
    """The checkpoint interval in steps (0: only at the end). `checkpoint.save_interval: null` gives
    train_iters / 10, clamped to [50, 1000]: a long run saves about ten times (a killed job loses at
    most a tenth of it, or 1000 steps), a short one does not spend its time writing checkpoints."""
    interval = cfg.checkpoint.save_interval
    if interval is not None:
        return interval
    return min(1000, max(50, cfg.train.train_iters // 10))


def existing_run(cfg: RunConfig) -> Optional[str]:
    """What shows that the run directory already holds a run (a path), or None when it holds none."""
    run_dir = Path(cfg.train.run_dir)
    for name in RUN_FILES:
        if (run_dir / name).is_file():
            return str(run_dir / name)
    checkpoints = save_dir(cfg)
    if (checkpoints / "latest").is_file():
        return str(checkpoints / "latest")
    if checkpoints.is_dir():
        for p in sorted(checkpoints.iterdir()):
            if STEP_DIR.match(p.name):
                return str(p)
    return None


def check_run_dir(cfg: RunConfig) -> None:
    """Refuse, in one line naming both fixes, to start a fresh run over an existing one. Starting with
    `checkpoint.load` set (auto, or a checkpoint) is the explicit request to continue in it."""
    if cfg.checkpoint.load:
        return
    found = existing_run(cfg)
    if found is not None:
        raise ConfigError(f"train.run_dir: {cfg.train.run_dir!r} already holds a run ({found}); resume it with "
                          "--checkpoint.load auto, or start a new run with another --train.run_dir")
