"""Megatron Core `torch_dist` checkpoint directories, read and written one layer's tensor at a time.

Layout (Megatron-LM): SAVE/latest_checkpointed_iteration.txt names `iter_XXXXXXX` (or `release`); that
directory is a PyTorch DCP checkpoint (`.metadata`, `*.distcp`) plus `metadata.json` naming the
backend. Megatron Core 0.19 keeps the common state (Megatron-LM's `args`, the iteration) as a DCP
bytes item `common_state/shard_0_1`; older versions keep it in `common.pt`. A per-layer tensor is one
global tensor with a leading layer axis, saved as one chunk per layer (per tensor-parallel shard too).

Reading runs no code from the files: `.metadata` goes through meshtron's allowlisted unpickler
(meshtron.checkpoint.dcp_safe, admitting the planner dataclasses Megatron's writer adds), each chunk
a tensor is made of is read from its byte range with `torch.load(weights_only=True)`, and the common
state is read the same way with Megatron's own classes (enums, configs) replaced by inert stand-ins.

Writing: DCP's own writer with a planner that lists one chunk per layer and produces each chunk only
when the writer reaches it, so memory stays near one layer's tensor.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from meshtron.checkpoint.dcp_safe import DCP_METADATA, read_dcp_metadata, single_process_quiet
from meshtron.checkpoint.layout import CheckpointError
from meshtron.models.megatron.names import MegatronError

TRACKER = "latest_checkpointed_iteration.txt"
BACKEND_FILE = "metadata.json"
LEGACY_FILE = "model_optim_rng.pt"
COMMON_FILE = "common.pt"
COMMON_ITEM = "common_state/shard_0_1"
# Megatron's writer stores its save plan in `.metadata` too: plain dataclasses and an enum of torch's DCP.
_PLANNER_CLASSES = frozenset(("torch.distributed.checkpoint.planner", name)
                             for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"))


def iteration_dir(path: str | Path) -> Path:
    """The DCP directory of a Megatron save directory (through its tracker file) or of an iteration dir."""
    path = Path(path)
    if not path.is_dir():
        raise MegatronError(f"{str(path)!r} is not a directory; give a Megatron save directory (with {TRACKER}) "
                            "or one of its iter_XXXXXXX directories")
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text != "release" and not text.isdigit():
            raise MegatronError(f"{str(tracker)!r} holds {text[:40]!r}, not an iteration number or 'release'")
        path = path / ("release" if text == "release" else f"iter_{int(text):07d}")
        if not path.is_dir():
            raise MegatronError(f"{str(tracker)!r} names {path.name}, which is missing")
    if (path / LEGACY_FILE).is_file() or any(path.glob(f"mp_rank_*/{LEGACY_FILE}")):
        raise MegatronError(f"{str(path)!r} is a legacy per-rank Megatron checkpoint ({LEGACY_FILE}, a pickle meshtron "
                            "will not load); re-save it from Megatron-LM with --ckpt-format torch_dist")
    if not (path / DCP_METADATA).is_file():
        raise MegatronError(f"{str(path)!r} is not a Megatron torch_dist checkpoint (no {DCP_METADATA} and no {TRACKER})")
    return path


def _backend(path: Path) -> None:
    try:
        backend = json.loads((path / BACKEND_FILE).read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        raise MegatronError(f"{str(path)!r} has no readable {BACKEND_FILE}; it was not saved by Megatron Core's "
                            "dist_checkpointing") from None
    if backend != "torch_dist":
        raise MegatronError(f"{str(path / BACKEND_FILE)!r} names backend {backend!r}; meshtron reads torch_dist only")


class _Opaque:
    """Stands in for a class of Megatron's (an enum member, a config object) found in the common state:
    built from the pickled arguments without running any of that class's code."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


_ATTRIBUTE_BAGS = {"argparse.Namespace": argparse.Namespace, "types.SimpleNamespace": types.SimpleNamespace}


def load_common_state(blob: bytes, where: str) -> dict[str, Any]:
    """A torch.save'd common state read with weights_only=True; any global it names other than the two
    namespace classes is replaced by an inert `_Opaque` (so nothing of the file's choosing runs)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(blob))
        allowed = [_ATTRIBUTE_BAGS[n] if n in _ATTRIBUTE_BAGS else (_Opaque, n) for n in names]
        with torch.serialization.safe_globals(allowed):
            state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except Exception as e:
        raise MegatronError(f"{where}: the common state cannot be read without unpickling code "
                            f"({type(e).__name__}); pass the model with --config MODEL.yaml") from None
    if isinstance(state, list) and len(state) == 1:
        state = state[0]  # a ShardedObject's data is saved as a one-item list
    if not isinstance(state, dict):
        raise MegatronError(f"{where}: the common state is a {type(state).__name__}, not a dict")
    return state


class _FileRange(io.RawIOBase):
    """Bytes [begin, begin + length) of an open file as a seekable file of their own, so torch.load reads a
    chunk's tensor data straight into the tensor (no second copy of the chunk in a bytes buffer)."""

    def __init__(self, f, begin: int, length: int):
        super().__init__()
        self._f, self._begin, self._length, self._pos = f, begin, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        self._f.seek(self._begin + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


@dataclass
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    begin: int
    length: int


class MegatronCheckpoint:
    """The tensors of one torch_dist iteration directory: names and shapes from `.metadata`, data by chunk."""

    def __init__(self, path: str | Path):
        self.path = iteration_dir(path)
        _backend(self.path)
        files = {p.name: {"size": p.stat().st_size} for p in self.path.iterdir() if p.is_file()}
        try:
            metadata = read_dcp_metadata(self.path, {"files": files}, admit=_PLANNER_CLASSES)
        except CheckpointError as e:
            raise MegatronError(str(e)) from None
        self.sizes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.objects: set[str] = set()
        for name, entry in metadata.state_dict_metadata.items():
            if hasattr(entry, "size"):
                self.sizes[name], self.dtypes[name] = tuple(entry.size), entry.properties.dtype
            else:
                self.objects.add(name)
        self._chunks: dict[str, list[_Chunk]] = {}
        self._bytes: dict[str, _Chunk] = {}
        for index, info in metadata.storage_data.items():
            if index.fqn in self.sizes:
                sizes = next((tuple(c.sizes) for c in metadata.state_dict_metadata[index.fqn].chunks
                              if tuple(c.offsets) == tuple(index.offset)), None)
                if sizes is None:
                    raise MegatronError(f"{str(self.path)!r}: tensor {index.fqn!r} stores a chunk its metadata lacks")
                self._chunks.setdefault(index.fqn, []).append(
                    _Chunk(tuple(index.offset), sizes, info.relative_path, info.offset, info.length))
            else:
                self._bytes[index.fqn] = _Chunk((), (), info.relative_path, info.offset, info.length)

    def _read_bytes(self, chunk: _Chunk) -> bytes:
        with open(self.path / chunk.file, "rb") as f:
            f.seek(chunk.begin)
            data = f.read(chunk.length)
        if len(data) != chunk.length:
            raise MegatronError(f"{str(self.path / chunk.file)!r} is truncated")
        return data

    def read(self, name: str, layer: Optional[int] = None) -> torch.Tensor:
        """Tensor `name`, or its entry `layer` along the leading (layer) axis, assembled from its chunks."""
        size = self.sizes[name]
        shape = size if layer is None else size[1:]
        out: Optional[torch.Tensor] = None
        filled = 0
        for chunk in self._chunks.get(name, []):
            lo = chunk.offsets[0] if layer is not None else 0
            if layer is not None and not lo <= layer < lo + chunk.sizes[0]:
                continue
            try:
                with open(self.path / chunk.file, "rb") as f:
                    if chunk.begin + chunk.length > os.fstat(f.fileno()).st_size:
                        raise MegatronError(f"{str(self.path / chunk.file)!r} is truncated")
                    data = torch.load(io.BufferedReader(_FileRange(f, chunk.begin, chunk.length)), weights_only=True,
                                      map_location="cpu")
            except MegatronError:
                raise
            except Exception as e:
                raise MegatronError(f"{str(self.path / chunk.file)!r}: a chunk of {name!r} is not a plain tensor "
                                    f"({type(e).__name__})") from None
            if not isinstance(data, torch.Tensor) or tuple(data.shape) != chunk.sizes:
                raise MegatronError(f"{str(self.path)!r}: a chunk of {name!r} does not have the shape its metadata gives")
            piece, offsets = (data, chunk.offsets) if layer is None else (data[layer - lo], chunk.offsets[1:])
            if tuple(piece.shape) == shape:  # one chunk holds all of it: no copy into a buffer
                return piece
            if out is None:
                out = torch.empty(shape, dtype=self.dtypes[name])
            out[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))] = piece
            filled += piece.numel()
        if out is None or filled != out.numel():
            raise MegatronError(f"{str(self.path)!r}: the chunks of {name!r} do not cover it"
                                + ("" if layer is None else f" for layer {layer}"))
        return out

    def common_state(self) -> dict[str, Any]:
        if (self.path / COMMON_FILE).is_file():
            return load_common_state((self.path / COMMON_FILE).read_bytes(), str(self.path / COMMON_FILE))
        if COMMON_ITEM not in self._bytes:
            raise MegatronError(f"{str(self.path)!r} has neither {COMMON_FILE} nor a {COMMON_ITEM} item; "
                                "pass the model with --config MODEL.yaml")
        return load_common_state(self._read_bytes(self._bytes[COMMON_ITEM]), f"{str(self.path)!r}")


# ---- writing -----------------------------------------------------------------------------------

@dataclass
class TensorOut:
    """One global tensor to write: its chunks as (offsets, sizes, produce) with produce() -> the chunk."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], Callable[[], torch.Tensor]]] = field(default_factory=list)


class _ChunkPlanner(DefaultSavePlanner):
    """A save plan of the given chunks and objects; each chunk produced when the writer asks for it."""

    def __init__(self, tensors: list[TensorOut], objects: dict[str, Any]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._tensors, self._objects = tensors, objects
        self._produce = {(t.name, offsets): (produce, sizes, t.dtype)
                         for t in tensors for offsets, sizes, produce in t.chunks}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(t.name, torch.Size(offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                       properties=TensorProperties(dtype=t.dtype), size=torch.Size(t.shape)))
                 for t in self._tensors for offsets, sizes, _ in t.chunks]
        items += [WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO) for name in self._objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save([self._objects[write_item.index.fqn]], buffer)  # Megatron's ShardedObject encoding
            buffer.seek(0)
            return buffer
        produce, sizes, dtype = self._produce[(write_item.index.fqn, tuple(write_item.index.offset))]
        tensor = produce()
        assert tuple(tensor.shape) == sizes and tensor.dtype == dtype, (write_item.index.fqn, tensor.shape, sizes)
        return tensor.contiguous()


def write_dcp(directory: Path, tensors: list[TensorOut], objects: dict[str, Any]) -> None:
    """A torch_dist iteration directory: the DCP files and metadata.json (the directory exists and is empty)."""
    writer = FileSystemWriter(str(directory), single_file_per_rank=False, thread_count=1)
    with single_process_quiet():
        dcp.save({}, storage_writer=writer, planner=_ChunkPlanner(tensors, objects))
    (directory / BACKEND_FILE).write_text(json.dumps({"sharded_backend": "torch_dist",
                                                      "sharded_backend_version": 1}))
