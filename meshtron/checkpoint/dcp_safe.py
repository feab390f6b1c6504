"""DCP loading that runs no code from the checkpoint. DCP's `.metadata` is a pickle and DCP reads
non-tensor values with `torch.load(weights_only=False)`; here `.metadata` is read by an unpickler
that admits only the classes DCP writes into it (its metadata dataclasses, torch.Size, dtypes,
layouts, paths), its file references are checked against the manifest, and DCP is handed that
already-read metadata and a planner that reads non-tensor values with `weights_only=True`.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from meshtron.checkpoint.layout import CheckpointError, require_listed

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

DCP_METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint"
# What DCP pickles into `.metadata` (checked against torch 2.13's FileSystemWriter): nothing here
# runs code when built from pickle data; each is a dataclass, an enum, a tuple subclass or a path.
_ADMITTED = {
    (f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name in torch's own table
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # Python >= 3.13
    ("pathlib._local", "WindowsPath"), ("pathlib._local", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the admitted classes; any other global (os.system, builtins.eval, ...) is refused."""

    def __init__(self, data: bytes, path: Path, admit: frozenset[tuple[str, str]] = frozenset()):
        super().__init__(io.BytesIO(data))
        self.path = path
        self.admit = admit

    def find_class(self, module: str, name: str) -> Any:
        # dtypes by their attribute of torch, looked up in its namespace (never torch's lazy __getattr__)
        if (module, name) in _ADMITTED or (module, name) in self.admit or (module == "torch" and isinstance(vars(torch).get(name), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{str(self.path)!r} refers to {module}.{name}, which DCP metadata never holds; "
                              "refusing to load it (the file was not written by DCP, or was tampered with)")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{str(self.path)!r} holds a persistent reference, which DCP metadata never holds")


def _malformed(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{str(path)!r} is not usable DCP metadata: {why}")


def read_dcp_metadata(step_dir: Path, manifest: dict[str, Any],
                      admit: frozenset[tuple[str, str]] = frozenset()) -> Metadata:
    """`step_dir/.metadata` read without running code, its types and file references checked.

    admit: further (module, class) pairs a caller knows its writer adds (plain dataclasses only).
    """
    require_listed(step_dir, manifest, DCP_METADATA)
    path = step_dir / DCP_METADATA
    try:
        metadata = _MetadataUnpickler(path.read_bytes(), path, admit).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or garbled pickle data, or an admitted class given bad arguments
        raise _malformed(path, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(metadata, Metadata):
        raise _malformed(path, f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    sdm, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(sdm, dict) or not all(isinstance(k, str) and isinstance(v, (TensorStorageMetadata,
                                                                                 BytesStorageMetadata))
                                            for k, v in sdm.items()):
        raise _malformed(path, "state_dict_metadata must map names to tensor or bytes entries")
    for name, entry in sdm.items():
        if isinstance(entry, TensorStorageMetadata) and not _tensor_entry_ok(entry):
            raise _malformed(path, f"the entry of {name!r} must give a size, a dtype and chunks")
    if not isinstance(storage, dict):
        raise _malformed(path, "storage_data must map items to file ranges")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or type(info).__name__ != "_StorageInfo":
            raise _malformed(path, "storage_data must map items to file ranges")
        if not isinstance(info.relative_path, str) or info.relative_path not in manifest["files"]:
            raise _malformed(path, f"item {index.fqn!r} is stored in {info.relative_path!r}, which is not a file "
                             "listed in the checkpoint's manifest")
        if getattr(info, "transform_descriptors", None):  # compression etc.: meshtron never writes them
            raise _malformed(path, f"item {index.fqn!r} asks for storage transforms {info.transform_descriptors!r}")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0 \
                or info.offset + info.length > manifest["files"][info.relative_path]["size"]:
            raise _malformed(path, f"item {index.fqn!r} has a byte range outside {info.relative_path}")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise _malformed(path, "storage_meta has the wrong type")
    return metadata


def _tensor_entry_ok(entry: TensorStorageMetadata) -> bool:
    def is_size(x: Any) -> bool:
        return isinstance(x, torch.Size) and all(type(d) is int and d >= 0 for d in x)

    chunks = entry.chunks
    return (is_size(entry.size) and isinstance(getattr(entry.properties, "dtype", None), torch.dtype)
            and isinstance(chunks, list) and all(isinstance(c, ChunkStorageMetadata) and is_size(c.offsets)
                                                  and is_size(c.sizes) for c in chunks))


class _VerifiedReader(FileSystemReader):
    """A FileSystemReader that hands DCP the metadata read and checked above instead of unpickling it."""

    def __init__(self, step_dir: Path, metadata: Metadata):
        super().__init__(str(step_dir))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # rank-local metadata files are never written by meshtron
            raise CheckpointError(f"checkpoint {str(self.path)!r} has no rank-local metadata")
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _PlainDataPlanner(DefaultLoadPlanner):
    """Non-tensor values (optimizer settings such as lr and betas) are read by PyTorch's weights_only
    loader, which builds plain data and tensors only (DefaultLoadPlanner would run any pickle)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # UnpicklingError for a refused global; others for garbled bytes
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"item {read_item.dest_index.fqn!r} holds something other than plain data; "
                                  f"refusing to load it ({first[:200]})") from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:  # the same placement as DefaultLoadPlanner.load_bytes
            _set_nested(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _set_nested(root: Any, path: tuple, value: Any) -> None:
    """root[path[0]][path[1]]...[path[-1]] = value; the containers exist (they come from our own state)."""
    for key in path[:-1]:
        root = root[key]
    root[path[-1]] = value


@contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _inner_checkpoint_error(e: BaseException) -> CheckpointError | None:
    """The CheckpointError one of our hooks raised inside DCP, which wraps it in a CheckpointException."""
    for failure in getattr(e, "failures", {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointError):
            return exc
    return None


def load_dcp(state: dict[str, Any], step_dir: Path, metadata: Metadata) -> None:
    """dcp.load of `state` in place from `step_dir`, with the checked metadata; one-line errors."""
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=_VerifiedReader(step_dir, metadata), planner=_PlainDataPlanner())
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        inner = _inner_checkpoint_error(e)
        if inner is not None:
            raise CheckpointError(f"checkpoint {str(step_dir)!r}: {inner}") from None
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(step_dir)!r} does not match this model: {first}") from None
