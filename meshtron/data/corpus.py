"""The embedded default corpus: the CPython standard library sources of the running interpreter,
present on every machine (`sysconfig.get_paths()["stdlib"]`), in a fixed, sorted order."""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every .py file under the stdlib directory, excluding installed packages, sorted by path."""
    root = root or stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files)


def iter_stdlib_documents(root: Path | None = None) -> Iterator[tuple[str, str]]:
    """Yield (relative path, text) for each stdlib source file; undecodable bytes are replaced."""
    root = root or stdlib_root()
    for path in stdlib_files(root):
        yield str(path.relative_to(root)), path.read_bytes().decode("utf-8", errors="replace")


STDLIB_LICENSE = "PSF-2.0"  # the Python Software Foundation License covers the standard library sources


def write_stdlib_jsonl(output: str | Path, root: Path | None = None, max_documents: int | None = None) -> int:
    """Write one JSON line {"text", "path", "license"} per stdlib source file (the first `max_documents`
    by path when given); returns the number written."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for rel_path, text in iter_stdlib_documents(root):
            if max_documents is not None and count >= max_documents:
                break
            f.write(json.dumps({"text": text, "path": rel_path, "license": STDLIB_LICENSE}, ensure_ascii=False) + "\n")
            count += 1
    tmp.replace(out)
    return count
