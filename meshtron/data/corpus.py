"""The embedded default corpus: the CPython standard library sources of the running interpreter,
present on every machine (`sysconfig.get_paths()["stdlib"]`), in a fixed, sorted order."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator

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
