"""Reading documents from jsonl and text inputs, and cutting the inputs into work shards.

A shard is a byte range of one line-oriented file (jsonl, or text read one document per line), or
a run of whole text files (one document per file). Shards are planned from file sizes alone, so a
resumed run plans the same shards; each reads only its own bytes, so memory stays bounded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# Our own outputs, which may sit inside an input directory, are never read as text.
OUTPUT_SUFFIXES = (".bin", ".idx", ".partial", ".npy")
DEFAULT_SHARD_BYTES = 16 << 20


@dataclass(frozen=True)
class Shard:
    """Documents of `paths`: bytes [start, end) of one line-oriented file, or several whole files."""

    paths: tuple[str, ...]
    start: int = 0
    end: int = -1
    kind: str = "jsonl"  # jsonl | lines | files

    @property
    def num_bytes(self) -> int:
        if self.kind == "files":
            return sum(os.path.getsize(p) for p in self.paths)
        return self.end - self.start


def list_input_files(inputs: list[str]) -> list[Path]:
    """Files named directly, plus every non-hidden file under named directories, in sorted order
    (skipping .bin/.idx/.npy outputs and PREFIX.shards/ directories)."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = [f for f in sorted(p.rglob("*"))
                     if f.is_file() and not f.name.endswith(OUTPUT_SUFFIXES)
                     and not any(part.startswith(".") or part.endswith(".shards") for part in f.relative_to(p).parts)]
            files += found
        else:
            raise ValueError(f"--input: {item!r} is neither a file nor a directory")
    if not files:
        raise ValueError(f"--input: no files found in {', '.join(inputs)}")
    return files


def is_jsonl(path: Path | str) -> bool:
    return str(path).endswith(JSONL_SUFFIXES)


def plan_shards(inputs: list[str], *, text_unit: str = "file", shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Shard]:
    """Cut the inputs into shards of about `shard_bytes`, in input order (the output keeps this order)."""
    if text_unit not in ("file", "line"):
        raise ValueError(f"--text-unit: {text_unit!r} is not allowed; choose file or line")
    shards: list[Shard] = []
    group: list[str] = []
    group_bytes = 0
    for f in list_input_files(inputs):
        size = f.stat().st_size
        if is_jsonl(f) or text_unit == "line":
            if group:
                shards.append(Shard(tuple(group), kind="files"))
                group, group_bytes = [], 0
            kind = "jsonl" if is_jsonl(f) else "lines"
            for start in range(0, max(size, 1), shard_bytes):
                shards.append(Shard((str(f),), start, min(start + shard_bytes, size), kind))
        else:
            group.append(str(f))
            group_bytes += size
            if group_bytes >= shard_bytes:
                shards.append(Shard(tuple(group), kind="files"))
                group, group_bytes = [], 0
    if group:
        shards.append(Shard(tuple(group), kind="files"))
    return shards


def _lines_in_range(path: str, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) for every line whose first byte lies in [start, end)."""
    with open(path, "rb") as f:
        if start > 0:
            # Skip the line that began before `start`: it belongs to the previous shard.
            f.seek(start - 1)
            f.readline()
        while True:
            offset = f.tell()
            if offset >= end:
                return
            line = f.readline()
            if not line:
                return
            yield offset, line


def iter_shard_documents(shard: Shard, json_key: str = "text") -> Iterator[str]:
    """The documents of one shard, in order; a malformed jsonl line is a ValueError naming file and byte."""
    if shard.kind == "files":
        for path in shard.paths:
            yield Path(path).read_bytes().decode("utf-8", errors="replace")
        return
    (path,) = shard.paths
    for offset, line in _lines_in_range(path, shard.start, shard.end):
        if not line.strip():
            continue
        if shard.kind == "lines":
            yield line.decode("utf-8", errors="replace").rstrip("\r\n")
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--input: {path} at byte {offset} is not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or json_key not in record:
            raise ValueError(f"--json-key: {path} at byte {offset} has no key {json_key!r}; "
                             "name the field that holds the text with --json-key")
        yield str(record[json_key])


def iter_documents(inputs: list[str], *, json_key: str = "text", text_unit: str = "file") -> Iterator[str]:
    """Every document of the inputs, in order."""
    for shard in plan_shards(inputs, text_unit=text_unit):
        yield from iter_shard_documents(shard, json_key)
