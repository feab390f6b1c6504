"""Checkpoints: atomic DCP saves with a `latest` pointer, verified (sizes, sha256) and loaded without
running code from the files; `upgrade_checkpoint` converts ones written before that format."""

from meshtron.checkpoint.carry import checkpoint_run_config
from meshtron.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    read_checkpoint_config,
    resolve_checkpoint,
    trainer_state_errors,
)
from meshtron.checkpoint.upgrade import upgrade_checkpoint

__all__ = ["CheckpointError", "CheckpointManager", "checkpoint_run_config", "load_checkpoint", "read_checkpoint_config", "resolve_checkpoint",
           "trainer_state_errors", "upgrade_checkpoint"]
