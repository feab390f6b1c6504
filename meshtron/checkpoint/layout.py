"""Where a checkpoint's files are and whether they are intact: step directory names, the `latest`
pointer (which must name a directory inside its save directory), and the manifest, which lists every
file with its size and sha256 and is checked before anything is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2  # 1 (no "format" key): {"files": {name: size}}; 2: {"files": {name: {"size", "sha256"}}}
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MAX_LATEST_BYTES = 4096
HASH_CHUNK = 1 << 20
HASH_THREADS = 4  # hashlib releases the GIL on large buffers, so files hash in parallel


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which one and why."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _read_latest(save_dir: Path) -> Path:
    """The step directory `save_dir/latest` names; it must be a plain directory name inside save_dir."""
    pointer = save_dir / LATEST
    try:
        with open(pointer, "rb") as f:
            raw = f.read(MAX_LATEST_BYTES + 1)
        name = raw.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(save_dir)!r}: 'latest' is unreadable ({e}); it must hold the name "
                              "of a step directory such as step_00000100") from None
    if len(raw) > MAX_LATEST_BYTES or not name or "\n" in name or name in (".", "..") or "/" in name or "\\" in name:
        raise CheckpointError(f"checkpoint {str(save_dir)!r}: 'latest' holds {name[:80]!r}, not the name of a "
                              "step directory inside it (such as step_00000100); fix or delete the file")
    step_dir = save_dir / name
    if step_dir.exists() and step_dir.resolve().parent != save_dir.resolve():
        raise CheckpointError(f"checkpoint {str(save_dir)!r}: 'latest' names {name!r}, a link to a directory "
                              "outside the save directory; refusing to follow it")
    if not step_dir.is_dir():
        raise CheckpointError(f"checkpoint {str(step_dir)!r} named by 'latest' is missing")
    return step_dir


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory, or a save directory whose `latest` names one -> the step directory."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist")
    if (p / LATEST).is_file():
        p = _read_latest(p)
    if not (p / MANIFEST).is_file():
        inside = p / "checkpoints"
        if (inside / LATEST).is_file() or (inside.is_dir() and any(STEP_DIR.match(c.name) for c in inside.iterdir())):
            raise CheckpointError(f"{str(p)!r} is a run directory, not a checkpoint; its checkpoints are in "
                                  f"{str(inside)!r}: give that path")
        raise CheckpointError(f"{str(p)!r} is not a complete checkpoint (no {MANIFEST}; "
                              "the save was interrupted or the path is wrong)")
    return p


def _bad_manifest(step_dir: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {str(step_dir)!r} has a malformed {MANIFEST}: {why}")


def _check_name(step_dir: Path, name: Any) -> None:
    """A manifest entry is a relative path that stays inside the step directory, links included."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name \
            or any(part in ("", ".", "..") for part in name.split("/")):
        raise _bad_manifest(step_dir, f"file name {name!r} is not a plain path inside the checkpoint")
    f = step_dir / name
    if f.exists() and not f.resolve().is_relative_to(step_dir.resolve()):
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {name} is a link to a file outside the checkpoint; "
                              "refusing to read it")


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The manifest, its types checked: {"step": int, "files": {name: {"size": int, "sha256": str|None}}}
    (a format-1 manifest's sizes are returned in the same shape with sha256 None)."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(step_dir)!r} has an unreadable {MANIFEST} ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise _bad_manifest(step_dir, "it must be a JSON object with a 'files' object")
    fmt = manifest.get("format", 1)
    if fmt not in (1, MANIFEST_FORMAT):
        raise _bad_manifest(step_dir, f"format {fmt!r} is not one this meshtron reads (1 or {MANIFEST_FORMAT})")
    step = manifest.get("step", 0)
    if type(step) is not int or step < 0:
        raise _bad_manifest(step_dir, f"'step' is {step!r}, not a non-negative integer")
    files: dict[str, dict[str, Any]] = {}
    for name, entry in manifest["files"].items():
        _check_name(step_dir, name)
        if fmt == 1:
            if type(entry) is not int or entry < 0:
                raise _bad_manifest(step_dir, f"the entry of {name} must be a size in bytes")
            files[name] = {"size": entry, "sha256": None}
            continue
        if not isinstance(entry, dict) or type(entry.get("size")) is not int or entry["size"] < 0 \
                or not isinstance(entry.get("sha256"), str) or not SHA256_HEX.fullmatch(entry["sha256"]):
            raise _bad_manifest(step_dir, f'the entry of {name} must be {{"size": bytes, "sha256": 64 hex digits}}')
        files[name] = {"size": entry["size"], "sha256": entry["sha256"]}
    return {"format": fmt, "step": step, "files": files}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def hash_files(directory: Path, names: list[str]) -> dict[str, str]:
    """{name: sha256} of the given files of `directory`."""
    if len(names) <= 1:
        return {name: sha256_file(directory / name) for name in names}
    with ThreadPoolExecutor(min(HASH_THREADS, len(names))) as pool:
        return dict(zip(names, pool.map(lambda n: sha256_file(directory / n), names)))


def write_manifest(directory: Path, step: int, known: Optional[dict[str, str]] = None,
                   exclude: tuple[str, ...] = ()) -> None:
    """Write the manifest of every file under `directory` but `exclude`; `known` holds sha256s
    already computed (the shards other ranks hashed), the rest are hashed here."""
    known = known or {}
    names = [str(f.relative_to(directory)) for f in sorted(directory.rglob("*")) if f.is_file()]
    names = [n for n in names if n not in (MANIFEST, MANIFEST + ".tmp", *exclude)]
    digests = {**hash_files(directory, [n for n in names if n not in known]), **known}
    files = {n: {"size": (directory / n).stat().st_size, "sha256": digests[n]} for n in names}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "step": step, "files": files}, indent=1))
    os.replace(tmp, directory / MANIFEST)


def _check_sizes(step_dir: Path, files: dict[str, dict[str, Any]]) -> None:
    for name, entry in files.items():
        f = step_dir / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(step_dir)!r} is missing {name}")
        if f.stat().st_size != entry["size"]:
            raise CheckpointError(f"checkpoint {str(step_dir)!r} is truncated: {name} has "
                                  f"{f.stat().st_size} bytes, expected {entry['size']}")


def _hash_mismatches(step_dir: Path, files: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    actual = hash_files(step_dir, names)
    return [n for n in names if actual[n] != files[n]["sha256"]]


def verify_checkpoint(step_dir: Path, only: Optional[list[str]] = None, split_over_ranks: bool = False) -> dict[str, Any]:
    """Check every manifest file exists with its size and (for `only` those files, else all) its
    sha256; return the manifest. split_over_ranks: each rank of the default process group hashes
    its share and the ranks agree on the verdict (a collective: every rank must call it)."""
    manifest = read_manifest(step_dir)
    files = manifest["files"]
    _check_sizes(step_dir, files)
    if manifest["format"] == 1:
        warnings.warn(f"checkpoint {str(step_dir)!r} has a manifest without sha256 hashes (written by an older "
                      "meshtron): sizes are checked, contents are not; `meshtron checkpoint upgrade` adds them",
                      stacklevel=2)
        return manifest
    names = sorted(files) if only is None else [n for n in only if n in files]
    spread = split_over_ranks and dist.is_initialized() and dist.get_world_size() > 1
    if spread:
        names = names[dist.get_rank()::dist.get_world_size()]
    bad = _hash_mismatches(step_dir, files, names)
    if spread:
        everyone: list[Optional[list[str]]] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, bad)
        bad = sorted(n for part in everyone for n in part or [])
    if bad:
        raise CheckpointError(f"checkpoint {str(step_dir)!r} is corrupt: {bad[0]} does not match the sha256 in its "
                              f"{MANIFEST} (changed after it was written); restore it or load another checkpoint")
    return manifest


def require_listed(step_dir: Path, manifest: dict[str, Any], name: str) -> None:
    """A file meshtron reads must be covered by the manifest (present, sized, hashed)."""
    if name not in manifest["files"]:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {name} is not listed in its {MANIFEST}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
