"""Meshtron checkpoints written and read one tensor at a time, for conversion.

Writing: the checkpoint layout and atomicity are `meshtron.checkpoint`'s (a temporary directory,
DCP files, the trainer state, config.yaml, the manifest with sha256s last, rename, then `latest`). DCP plans a
save from the shapes alone, so the state dict given to it holds meta tensors, and a save planner
produces each real tensor only when the writer asks for it (`resolve_data`). With one file per
tensor the writer keeps no more than the tensor it is writing, so memory stays near the largest
tensor instead of the model.

Reading: DCP loads exactly the keys of the state dict it is given, so one `dcp.load` per tensor
reads one tensor; the shapes come from the checkpoint's metadata, read and checked without pickle
(meshtron.checkpoint.dcp_safe).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

# The checkpoint module's own layout helpers, so a converted checkpoint is the same kind of directory.
from meshtron.checkpoint.dcp_safe import load_dcp, read_dcp_metadata, single_process_quiet
from meshtron.checkpoint.layout import fsync_dir, resolve_checkpoint, step_dir_name, verify_checkpoint, write_manifest
from meshtron.checkpoint.state_io import write_trainer_state

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

MODEL_PREFIX = "model."


class _ProducingPlanner(DefaultSavePlanner):
    """A save planner whose tensors are produced on demand from their flattened key."""

    def __init__(self, produce: Callable[[str], torch.Tensor]):
        super().__init__()
        self._produce = produce

    def resolve_data(self, write_item):
        return self._produce(write_item.index.fqn)


def write_model_checkpoint(save_dir: str | Path, step: int, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                           produce: Callable[[str], torch.Tensor], trainer_state: dict[str, Any], config_yaml: str,
                           extra_dirs: Optional[dict[str, Callable[[Path], None]]] = None) -> Path:
    """Write a model-only checkpoint `save_dir/step_XXXXXXXX` and point `latest` at it.

    shapes: {parameter name: (shape, dtype)}; produce(name) returns that parameter's tensor.
    extra_dirs: {sub-directory: fill(path)} written inside the step directory before the manifest.
    """
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    final = save_dir / step_dir_name(step)
    tmp = save_dir / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {"model": {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}}

    def produce_flat(fqn: str) -> torch.Tensor:
        name = fqn[len(MODEL_PREFIX):]
        shape, dtype = shapes[name]
        tensor = produce(name)
        assert tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype, (name, tensor.shape, shape)
        return tensor.contiguous()

    writer = FileSystemWriter(str(tmp), single_file_per_rank=False, thread_count=1)
    with single_process_quiet():
        dcp.save(state, storage_writer=writer, planner=_ProducingPlanner(produce_flat))
    write_trainer_state(tmp, trainer_state)
    (tmp / "config.yaml").write_text(config_yaml)
    for sub, fill in (extra_dirs or {}).items():
        (tmp / sub).mkdir(parents=True, exist_ok=True)
        fill(tmp / sub)
    write_manifest(tmp, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    latest_tmp = save_dir / "latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, save_dir / "latest")
    return final


class CheckpointTensors:
    """The model tensors of a meshtron checkpoint: names and shapes from metadata, data one at a time."""

    def __init__(self, path: str | Path):
        self.step_dir = resolve_checkpoint(path)
        self.metadata = read_dcp_metadata(self.step_dir, verify_checkpoint(self.step_dir))
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for key, meta in self.metadata.state_dict_metadata.items():
            if key.startswith(MODEL_PREFIX) and hasattr(meta, "size"):
                self.shapes[key[len(MODEL_PREFIX):]] = (tuple(meta.size), meta.properties.dtype)

    def get(self, name: str) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        state = {"model": {name: torch.empty(shape, dtype=dtype)}}
        load_dcp(state, self.step_dir, self.metadata)
        return state["model"][name]
