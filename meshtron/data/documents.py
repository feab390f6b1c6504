"""Reading documents from jsonl and text inputs, and cutting the inputs into work shards.

A shard is a byte range of one line-oriented file (jsonl, or text read one document per line), or
a run of whole text files (one document per file). Shards are planned from file sizes alone, so a
resumed run plans the same shards; each reads only its own bytes, so memory stays bounded.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# Our own outputs, which may sit inside an input directory, are never read as text.
OUTPUT_SUFFIXES = (".bin", ".idx", ".partial", ".npy", ".meshtron.json")   # .meshtron.json: sidecars
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


def line_number(path: str, offset: int) -> int:
    """1-based number of the line starting at byte `offset`: newlines before it are counted only when an
    error is reported, so a worker that starts mid-file (its shard) still names the right line."""
    count, remaining = 0, offset
    with open(path, "rb") as f:
        while remaining > 0 and (chunk := f.read(min(remaining, 16 << 20))):
            count, remaining = count + chunk.count(b"\n"), remaining - len(chunk)
    return count + 1


_JSON_KINDS = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "a list",
               dict: "an object"}
_SURROGATE = re.compile("[\ud800-\udfff]")


def _text_of(record, json_key: str, path: str, offset: int) -> str:
    """The string at json_key; anything else (null, number, list, object, a lone surrogate) is refused."""
    if not isinstance(record, dict) or json_key not in record:
        raise ValueError(f"--json-key: {path} line {line_number(path, offset)} has no key {json_key!r}; "
                         "name the field that holds the text with --json-key")
    text = record[json_key]
    if not isinstance(text, str):
        raise ValueError(f"--input: {path} line {line_number(path, offset)}: {json_key!r} is "
                         f"{_JSON_KINDS.get(type(text), type(text).__name__)}, not a string; fix or drop that line")
    if (bad := lone_surrogate(text)) is not None:
        raise ValueError(f"--input: {path} line {line_number(path, offset)}: {json_key!r} holds {bad}, which is not "
                         "text; fix or drop that line")
    return text


def lone_surrogate(text: str) -> str | None:
    """Describe the first lone surrogate in `text` (None when there is none). A JSON escape such as
    "\ud800" outside a surrogate pair decodes to such a code point: not text, and not encodable."""
    bad = _SURROGATE.search(text)
    return None if bad is None else f"a lone surrogate U+{ord(bad.group()):04X} at character {bad.start()}"


def iter_shard_documents(shard: Shard, json_key: str = "text") -> Iterator[str]:
    """The documents of one shard, in order; a malformed jsonl line is a ValueError naming file and line."""
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
            raise ValueError(f"--input: {path} line {line_number(path, offset)} is not valid JSON ({e.msg})") from None
        yield _text_of(record, json_key, path, offset)


def iter_documents(inputs: list[str], *, json_key: str = "text", text_unit: str = "file") -> Iterator[str]:
    """Every document of the inputs, in order."""
    for shard in plan_shards(inputs, text_unit=text_unit):
        yield from iter_shard_documents(shard, json_key)
