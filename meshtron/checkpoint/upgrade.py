"""Checkpoints written before the pickle-free format: their `trainer_state.pt` (torch.save) and
hash-less manifests. Loading reads trainer_state.pt only through PyTorch's weights_only loader; the
old trainer states hold numpy RNG arrays, which that loader refuses, so loading them stops with the
command that converts them: `meshtron checkpoint upgrade PATH`, run knowingly on one's own files.
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from meshtron.checkpoint.dcp_safe import read_dcp_metadata
from meshtron.checkpoint.layout import (
    LATEST,
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    verify_checkpoint,
    write_manifest,
)
from meshtron.checkpoint.state_io import write_trainer_state

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

LEGACY_STATE = "trainer_state.pt"


def _check_legacy(step_dir: Path, state: Any) -> dict[str, Any]:
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {LEGACY_STATE} does not hold a trainer state dict")
    return state


def read_legacy_state(step_dir: Path) -> dict[str, Any]:
    """trainer_state.pt through `torch.load(weights_only=True)`, which builds tensors and plain data
    only; anything else in it (the numpy RNG arrays of every old trainer state) is refused."""
    try:
        state = torch.load(step_dir / LEGACY_STATE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _refused_global(e)
        if refused is not None and not refused.startswith("numpy."):
            raise _foreign(step_dir, refused, "refusing to load it") from None
        raise CheckpointError(
            f"checkpoint {str(step_dir)!r} keeps its trainer state in the old {LEGACY_STATE}, which holds Python "
            f"objects that meshtron no longer unpickles on load; if you wrote this checkpoint, convert it once with "
            f"`meshtron checkpoint upgrade {step_dir}`") from None
    except Exception as e:  # not a torch.save file, or a damaged one
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {LEGACY_STATE} is unreadable ({first[:200]})") from None
    return _check_legacy(step_dir, state)


def _refused_global(e: Exception) -> Optional[str]:
    """The global PyTorch's weights_only loader refused, from its message ("... GLOBAL posix.system ...")."""
    match = re.search(r"GLOBAL ([\w.]+)", str(e))
    return match.group(1) if match else None


def _foreign(step_dir: Path, name: str, action: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {str(step_dir)!r}: {LEGACY_STATE} holds {name}, which a meshtron trainer "
                           f"state never holds; {action} (the file was not written by meshtron, or was tampered with)")


def _numpy_globals() -> list[Any]:
    """What an old trainer state's numpy RNG state (a uint32 key array) pickles to, under numpy 1 and 2."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
            (rebuild, "numpy.core.multiarray._reconstruct"), (rebuild, "numpy._core.multiarray._reconstruct")]


def read_legacy_state_trusted(step_dir: Path) -> dict[str, Any]:
    """trainer_state.pt through the weights_only loader with numpy's array reconstruction admitted
    too: PyTorch leaves that out because numpy's functions are outside its control. For the upgrade
    command only, which the user runs on files they trust."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            state = torch.load(step_dir / LEGACY_STATE, map_location="cpu", weights_only=True)
    except Exception as e:
        refused = _refused_global(e)
        if refused is not None:
            raise _foreign(step_dir, refused, "not converted") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {LEGACY_STATE} is unreadable ({first[:200]}); "
                              "not converted") from None
    return _check_legacy(step_dir, state)


def upgrade_step_dir(step_dir: Path) -> bool:
    """Convert one step directory in place; False when it is already current. The new state files and
    the new manifest are written before trainer_state.pt goes, so an interruption leaves either the old
    checkpoint or the new one, and the command can be run again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hash-less manifest warning: fixing that is the point here
        manifest = verify_checkpoint(step_dir)
    if manifest["format"] != 1 and LEGACY_STATE not in manifest["files"]:
        return False
    read_dcp_metadata(step_dir, manifest)  # a crafted .metadata is refused here as on load
    if LEGACY_STATE in manifest["files"]:
        write_trainer_state(step_dir, read_legacy_state_trusted(step_dir))
    write_manifest(step_dir, manifest["step"], exclude=(LEGACY_STATE,))
    (step_dir / LEGACY_STATE).unlink(missing_ok=True)
    return True


def upgrade_checkpoint(path: str | Path) -> list[tuple[Path, bool]]:
    """Upgrade a step directory, or every step directory of a save directory: [(step dir, changed)]."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist")
    if (p / MANIFEST).is_file():
        steps = [p]
    else:
        steps = sorted(d for d in p.iterdir() if d.is_dir() and STEP_DIR.match(d.name) and (d / MANIFEST).is_file())
        if not steps:
            hint = " (its 'latest' names no complete step directory)" if (p / LATEST).is_file() else ""
            raise CheckpointError(f"{str(p)!r} holds no checkpoint to upgrade{hint}")
    return [(step_dir, upgrade_step_dir(step_dir)) for step_dir in steps]
