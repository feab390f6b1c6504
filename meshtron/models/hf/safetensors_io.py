"""Safetensors files read and written one tensor at a time.

Reading: a Hugging Face model directory holds `model.safetensors`, or shards named by
`model.safetensors.index.json` ({"weight_map": {tensor: file}}). `SafetensorsDir` reads every
header once (names, dtypes, shapes, byte ranges) and then one tensor's bytes at a time.

Writing: a safetensors file is an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded with spaces
to a multiple of 8, then the raw bytes of every tensor back to back. Since shapes and dtypes are
known before any data, `write_sharded` writes each header first and then streams the tensors in,
so at most one tensor is in memory. Shards follow the Hugging Face naming
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` beside them.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


class SafetensorsError(ValueError):
    """A model directory whose safetensors files cannot be used; the message names the file or tensor."""


class SafetensorsDir:
    """Lazy view of the safetensors weights of a directory: names, shapes, dtypes, one tensor at a time.

    Headers are parsed here and each tensor is read with a plain positioned read into its own
    buffer, so nothing stays mapped: memory-mapping the files would keep every page read so far
    resident in this process, and the streaming conversion would grow to the size of the model.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            files = _index_files(index)
        elif (self.directory / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            raise SafetensorsError(f"{str(self.directory)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}; "
                                   "meshtron reads Hugging Face weights in safetensors format only")
        self.file_of: dict[str, str] = {}
        self._entries: dict[str, tuple[str, torch.dtype, tuple[int, ...], int, int]] = {}
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise SafetensorsError(f"{str(path)!r} is named by {INDEX_FILE} but missing")
            for key, entry in _read_header(path).items():
                self.file_of[key] = name
                self._entries[key] = (name, *entry)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name][1]

    def get(self, name: str) -> torch.Tensor:
        file_name, dtype, shape, begin, end = self._entries[name]
        buffer = bytearray(end - begin)
        with open(self.directory / file_name, "rb") as f:
            f.seek(begin)
            if f.readinto(buffer) != len(buffer):
                raise SafetensorsError(f"{str(self.directory / file_name)!r} is truncated at tensor {name!r}")
        if not buffer:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


def _index_files(index: Path) -> list[str]:
    """The shard files `model.safetensors.index.json` names; each must be a file name inside its directory."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise SafetensorsError(f"{str(index)!r} is not a readable index ({e})") from None
    if not isinstance(weight_map, dict):
        raise SafetensorsError(f"{str(index)!r} has no 'weight_map' object mapping tensor names to shard files")
    directory = index.parent.resolve()
    for name, file_name in weight_map.items():
        # a relative path below the index's directory: no '..', no absolute path, no link leading out
        if not isinstance(file_name, str) or not file_name or file_name.startswith("/") or "\\" in file_name \
                or any(part in ("", ".", "..") for part in file_name.split("/")) \
                or not (index.parent / file_name).resolve().is_relative_to(directory):
            raise SafetensorsError(f"{str(index)!r}: weight_map puts {name!r} in {file_name!r}, which is not a "
                                   "file inside the model directory")
    return sorted(set(weight_map.values()))


def _read_header(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """{tensor: (dtype, shape, absolute begin, absolute end)} from a safetensors file's header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        header_len = struct.unpack("<Q", raw)[0] if len(raw) == 8 else size
        if header_len > size - 8:
            raise SafetensorsError(f"{str(path)!r} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{str(path)!r} is not a safetensors file (header: {e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{str(path)!r} is not a safetensors file (the header is not a JSON object)")
    out = {}
    data_start = 8 + header_len
    for key, info in header.items():
        if key == "__metadata__":
            continue
        out[key] = _header_entry(path, key, info, data_start, size)
    return out


def _header_entry(path: Path, key: str, info: Any, data_start: int, size: int) -> tuple:
    """(dtype, shape, absolute begin, absolute end) of one header entry, its fields checked."""
    if not isinstance(info, dict) or not isinstance(info.get("shape"), list) \
            or not all(type(d) is int and d >= 0 for d in info["shape"]) \
            or not isinstance(info.get("data_offsets"), list) or len(info["data_offsets"]) != 2 \
            or not all(type(o) is int and o >= 0 for o in info["data_offsets"]):
        raise SafetensorsError(f"{str(path)!r}: the header entry of tensor {key!r} is malformed")
    if info.get("dtype") not in DTYPES_BY_NAME:
        raise SafetensorsError(f"{str(path)!r}: tensor {key!r} has dtype {info.get('dtype')}, which meshtron does not read")
    dtype, shape = DTYPES_BY_NAME[info["dtype"]], tuple(info["shape"])
    begin, end = info["data_offsets"]
    if data_start + end > size:
        raise SafetensorsError(f"{str(path)!r} is truncated: tensor {key!r} ends past the end of the file")
    if end - begin != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
        raise SafetensorsError(f"{str(path)!r}: tensor {key!r} has {end - begin} bytes for shape {list(shape)} "
                               f"{info['dtype']}")
    return dtype, shape, data_start + begin, data_start + end


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most `max_shard_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(specs: list[TensorSpec]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_sharded(directory: str | Path, specs: list[TensorSpec], produce: Callable[[TensorSpec], torch.Tensor],
                  max_shard_bytes: int) -> list[str]:
    """Write `specs` into shards plus the index, calling `produce(spec)` once per tensor, in order.

    Returns the shard file names. Each produced tensor must match its spec's shape and dtype.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(specs, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards):
        with open(directory / file_name, "wb") as f:
            f.write(_header(shard))
            for spec in shard:
                tensor = produce(spec)
                if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                    raise SafetensorsError(f"tensor {spec.name}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                                           f"expected {spec.shape} {spec.dtype}")
                _write_tensor(f, tensor)
                weight_map[spec.name] = file_name
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _write_tensor(f, tensor: torch.Tensor) -> None:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        f.write(flat.view(torch.uint8).numpy().data)  # raw little-endian bytes, no copy


def read_all(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory in memory at once (the non-streaming baseline)."""
    view = SafetensorsDir(directory)
    return {name: view.get(name) for name in view.keys()}
