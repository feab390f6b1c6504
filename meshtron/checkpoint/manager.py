"""Atomic, resumable checkpoints on `torch.distributed.checkpoint` (DCP).

Layout of a save directory:
    step_00000100/            one checkpoint: DCP files (model, optimizer), trainer_state.pt
                              (scheduler, step, RNG, data position), config.yaml, manifest.json
    latest                    text file naming the newest complete step directory
A checkpoint is written into `.tmp-step_...`, its manifest (every file with its size) written
last, then renamed into place; only then is `latest` replaced. A crash at any point leaves the
previous checkpoint complete and `latest` pointing at it. Loading checks the manifest first, so a
missing or truncated checkpoint is reported in one line and nothing is half-loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.utils._pytree import tree_map

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
STEP_DIR = re.compile(r"^step_(\d+)$")



@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which one and why."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory, or a save directory whose `latest` names one -> the step directory."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist")
    if (p / "latest").is_file():
        name = (p / "latest").read_text().strip()
        p = p / name
        if not p.is_dir():
            raise CheckpointError(f"checkpoint {str(p)!r} named by 'latest' is missing")
    if not (p / MANIFEST).is_file():
        raise CheckpointError(f"{str(p)!r} is not a complete checkpoint (no {MANIFEST}; "
                              "the save was interrupted or the path is wrong)")
    return p


def verify_checkpoint(step_dir: Path) -> dict[str, Any]:
    """Check every file listed in the manifest exists with its recorded size; return the manifest."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(step_dir)!r} has an unreadable manifest ({e})") from None
    for name, size in manifest["files"].items():
        f = step_dir / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(step_dir)!r} is missing {name}")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {str(step_dir)!r} is truncated: {name} has "
                                  f"{f.stat().st_size} bytes, expected {size}")
    return manifest


def _write_manifest(directory: Path, step: int) -> None:
    files = {str(f.relative_to(directory)): f.stat().st_size for f in sorted(directory.rglob("*")) if f.is_file()}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    os.replace(tmp, directory / MANIFEST)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
NESTED = StateDictOptions()  # checkpoints written before 24 Nov 2026: `optimizer.param_groups` as a list


def model_optimizer_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                          options: Optional[StateDictOptions] = None) -> dict[str, Any]:
    """DCP-ready state: `get_state_dict` gives keys by parameter name, so layouts can reshard. The
    optimizer state is flattened to one key per parameter and setting ("param_groups.<name>.lr"):
    the nested form keeps one `param_groups` list per rank under one key, and when pipeline stages
    hold different parameters only one rank's list would be saved."""
    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options or OPTIONS)
    return {"model": model_sd, "optimizer": optim_sd}


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class CheckpointManager:
    """Saves checkpoints under `save_dir`, keeping the newest `keep_last` (0 keeps all).

    With several processes every rank writes its shards through DCP and rank 0 alone does the
    directory work (temporary dir, manifest, rename, `latest`), between barriers. Saves use their own
    gloo group so an asynchronous save never interleaves its collectives with training's.
    """

    def __init__(self, save_dir: str | Path, keep_last: int = 3, async_save: bool = False, timeout_s: float = 600.0):
        self.save_dir = Path(save_dir)
        self.keep_last, self.async_save = keep_last, async_save
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            from datetime import timedelta

            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def save(self, step: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
             trainer_state: dict[str, Any], config_yaml: str,
             before_finalize: Optional[Callable[[Path], None]] = None) -> None:
        """Write checkpoint `step`. With async_save the tensors are copied now and written in a thread.

        `before_finalize(tmp_dir)` runs after the files are written and before the rename (a test hook
        to simulate a crash mid-save).
        """
        self.wait()
        state = model_optimizer_state(model, optimizer)
        if self.async_save:
            state = tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, state)
            trainer_state = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, trainer_state)
            self._thread = threading.Thread(
                target=self._write_guarded, args=(step, state, trainer_state, config_yaml, before_finalize), daemon=True)
            self._thread.start()
        else:
            self._write(step, state, trainer_state, config_yaml, before_finalize)

    def wait(self) -> None:
        """Block until a pending async save is on disk; re-raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"asynchronous checkpoint save failed: {err}") from err

    def _write_guarded(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            self._error = e

    def _write(self, step: int, state: dict[str, Any], trainer_state: dict[str, Any], config_yaml: str,
               before_finalize: Optional[Callable[[Path], None]]) -> None:
        final = self.save_dir / step_dir_name(step)
        tmp = self.save_dir / f".tmp-{final.name}"
        if _is_writer():
            self.save_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self._barrier()
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=str(tmp), process_group=self._group)
        self._barrier()
        if _is_writer():
            torch.save(trainer_state, tmp / TRAINER_STATE)
            (tmp / "config.yaml").write_text(config_yaml)
            _write_manifest(tmp, step)
            if before_finalize is not None:
                before_finalize(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.save_dir)
            latest_tmp = self.save_dir / "latest.tmp"
            latest_tmp.write_text(final.name + "\n")
            os.replace(latest_tmp, self.save_dir / "latest")
            self._prune()
        self._barrier()

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        steps = sorted(p for p in self.save_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name))
        for old in steps[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """Verify, then load model (and optimizer) state in place; return the trainer state."""
    step_dir = resolve_checkpoint(path)
    verify_checkpoint(step_dir)
    # --- issue 4: model-only checkpoints (converted from Hugging Face) hold weights and no optimizer
    # state; loading one restores the weights and leaves the optimizer fresh.
    trainer_state = torch.load(step_dir / TRAINER_STATE, weights_only=False)
    if trainer_state.get("model_only"):
        optimizer = None
    # ----------------------------------------------------------------------------------------------
    options = NESTED if optimizer is not None and _nested_optimizer_state(step_dir) else OPTIONS
    state = model_optimizer_state(model, optimizer, options)
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(step_dir))
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(step_dir)!r} does not match this model: {first}") from None
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=options)
    return trainer_state


def _nested_optimizer_state(step_dir: Path) -> bool:
    """Whether the checkpoint keeps the optimizer's param_groups as a nested list (the older form), whose
    first group has the key `optimizer.param_groups.0.params` (flattened keys are `...<name>.<setting>`)."""
    keys = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return "optimizer.param_groups.0.params" in keys


def read_checkpoint_config(path: str | Path) -> str:
    """The YAML text of the config saved with a checkpoint."""
    step_dir = resolve_checkpoint(path)
    verify_checkpoint(step_dir)
    return (step_dir / "config.yaml").read_text()
