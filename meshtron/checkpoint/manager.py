"""Atomic, resumable checkpoints on `torch.distributed.checkpoint` (DCP).

Layout of a save directory:
    step_00000100/            one checkpoint: DCP files (model, optimizer), trainer_state.json and
                              trainer_state.safetensors (step, RNG, data position), config.yaml, manifest.json
    latest                    text file naming the newest complete step directory
A checkpoint is written into `.tmp-step_...`, its manifest (every file with its size and sha256)
written last, then renamed into place; only then is `latest` replaced. A crash at any point leaves the
previous checkpoint complete and `latest` pointing at it. Loading checks the manifest first and runs
no code from the files (see layout.py, dcp_safe.py, state_io.py); a bad checkpoint is one line.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from meshtron.checkpoint.dcp_safe import load_dcp, read_dcp_metadata, single_process_quiet
from meshtron.checkpoint.layout import (
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    fsync_dir,
    hash_files,
    require_listed,
    resolve_checkpoint,
    step_dir_name,
    verify_checkpoint,
    write_manifest,
)
from meshtron.checkpoint.state_io import STATE_JSON, STATE_TENSORS, read_trainer_state, write_trainer_state
from meshtron.checkpoint.upgrade import LEGACY_STATE, read_legacy_state
from meshtron.compat import tree_map

TRAINER_STATE = STATE_JSON
CONFIG = "config.yaml"

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


def staging_options(on_cuda: bool):
    """Async-save staging: pinned host buffers and non-blocking device -> host copies on CUDA (a copy
    into pageable memory is synchronous and slower); plain host buffers on a CPU. Staging itself runs
    in the caller (the copies must finish before training changes the tensors), never shared memory."""
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(use_pinned_memory=on_cuda, use_shared_memory=False, use_async_staging=False,
                          use_non_blocking_copy=on_cuda)


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
        self._stager = None   # async saves: staging buffers reused from one save to the next
        self.extra_dirs: dict[str, Callable[[Path], None]] = {}
        self._group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            from datetime import timedelta

            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def save(self, step: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
             trainer_state: dict[str, Any], config_yaml: str,
             before_finalize: Optional[Callable[[Path], None]] = None,
             extra_dirs: Optional[dict[str, Callable[[Path], None]]] = None) -> None:
        """Write checkpoint `step`. With async_save the tensors are copied now and written in a thread.

        `before_finalize(tmp_dir)` runs after the files are written and before the rename (a test hook
        to simulate a crash mid-save). `extra_dirs`: {sub-directory: fill(path)}, files carried inside
        the checkpoint (the tokenizer, checkpoint/carry.py), written by rank 0 and listed in the manifest.
        """
        self.extra_dirs = extra_dirs or {}
        self.wait()
        state = model_optimizer_state(model, optimizer)
        if self.async_save:
            state = self._stage(state)
            trainer_state = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, trainer_state)
            self._thread = threading.Thread(
                target=self._write_guarded, args=(step, state, trainer_state, config_yaml, before_finalize), daemon=True)
            self._thread.start()
        else:
            self._write(step, state, trainer_state, config_yaml, before_finalize)

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """Host copies of the state for the writer thread, in staging buffers kept across saves (one
        per tensor storage: allocated, and pinned on CUDA, once; later saves copy into them). The
        previous save has finished (save() waits first), so its buffers are free to overwrite."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager

            self._stager = DefaultStager(staging_options(torch.cuda.is_available()))
        return self._stager.stage(state)

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
        with single_process_quiet():
            dcp.save(state, checkpoint_id=str(tmp), process_group=self._group)
        self._barrier()
        shard_hashes = self._hash_own_shards(tmp)
        if _is_writer():
            write_trainer_state(tmp, trainer_state)
            (tmp / CONFIG).write_text(config_yaml)
            for sub, fill in self.extra_dirs.items():
                fill(tmp / sub)
            write_manifest(tmp, step, known=shard_hashes)
            if before_finalize is not None:
                before_finalize(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.save_dir)
            latest_tmp = self.save_dir / "latest.tmp"
            latest_tmp.write_text(final.name + "\n")
            os.replace(latest_tmp, self.save_dir / "latest")
            self._prune()
        self._barrier()

    def _hash_own_shards(self, tmp: Path) -> dict[str, str]:
        """sha256 of the shard files this rank wrote (DCP names them `__<rank>_<n>.distcp`), gathered
        on rank 0: each rank hashes its own, so hashing costs one rank's shards, not the checkpoint."""
        if self._group is None:
            return {}
        rank = dist.get_rank(self._group)
        own = sorted(f.name for f in tmp.glob(f"__{rank}_*.distcp"))
        mine = hash_files(tmp, own)
        everyone: Optional[list[Optional[dict[str, str]]]] = [None] * dist.get_world_size(self._group) \
            if rank == 0 else None
        dist.gather_object(mine, everyone, dst=dist.get_global_rank(self._group, 0), group=self._group)
        return {} if everyone is None else {k: v for part in everyone for k, v in (part or {}).items()}

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        steps = sorted(p for p in self.save_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name))
        for old in steps[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """Verify (sizes and sha256 of every file, the split of the hashing shared by the ranks), then load
    model (and optimizer) state in place; return the trainer state. A collective under several processes."""
    step_dir = resolve_checkpoint(path)
    manifest = verify_checkpoint(step_dir, split_over_ranks=True)
    trainer_state = _read_trainer_state(step_dir, manifest)
    # --- issue 4: model-only checkpoints (converted from Hugging Face) hold weights and no optimizer
    # state; loading one restores the weights and leaves the optimizer fresh.
    if trainer_state.get("model_only"):
        optimizer = None
    # ----------------------------------------------------------------------------------------------
    metadata = read_dcp_metadata(step_dir, manifest)
    # older checkpoints keep the optimizer's param_groups as a nested list, whose first group has the
    # key `optimizer.param_groups.0.params` (flattened keys are `...<name>.<setting>`)
    nested = "optimizer.param_groups.0.params" in metadata.state_dict_metadata
    options = NESTED if optimizer is not None and nested else OPTIONS
    state = model_optimizer_state(model, optimizer, options)
    load_dcp(state, step_dir, metadata)
    try:
        if optimizer is None:
            set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=options)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:  # e.g. bytes where a tensor was
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(step_dir)!r} does not match this model: {first}") from None
    return trainer_state


def _read_trainer_state(step_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The trainer state in the format the manifest lists (the pickle-free one, or an old trainer_state.pt)."""
    if STATE_JSON in manifest["files"]:
        require_listed(step_dir, manifest, STATE_TENSORS)
        return read_trainer_state(step_dir)
    if LEGACY_STATE in manifest["files"]:
        return read_legacy_state(step_dir)
    raise CheckpointError(f"checkpoint {str(step_dir)!r} has no trainer state ({STATE_JSON} is not in its {MANIFEST})")


@contextmanager
def trainer_state_errors(path: str | Path) -> Iterator[None]:
    """Around a trainer applying a loaded trainer state: a missing field or a value of the wrong type
    or shape (a hand-edited trainer_state.json) becomes one CheckpointError line."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise CheckpointError(f"checkpoint {str(path)!r}: its trainer state does not fit this trainer ({what})") from None


def read_checkpoint_config(path: str | Path) -> str:
    """The YAML text of the config saved with a checkpoint (its size and sha256 checked)."""
    step_dir = resolve_checkpoint(path)
    manifest = verify_checkpoint(step_dir, only=[CONFIG])
    require_listed(step_dir, manifest, CONFIG)
    try:
        return (step_dir / CONFIG).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {CONFIG} is unreadable ({e})") from None
