"""Checkpoints: atomic DCP saves with a `latest` pointer, verified before they are loaded."""

from meshtron.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    read_checkpoint_config,
    resolve_checkpoint,
)

__all__ = ["CheckpointError", "CheckpointManager", "load_checkpoint", "read_checkpoint_config", "resolve_checkpoint"]
