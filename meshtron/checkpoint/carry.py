"""Self-contained checkpoints: the tokenizer's files travel inside every step directory and the
checkpoint's config.yaml names them relative to it, so a checkpoint works from any working directory
and on another machine. The Hugging Face converter carries a model's side files the same way (its
`hf/` directory). Older checkpoints name the tokenizer by an absolute or working-directory path; those
still load (a relative path that is not inside the step directory is read as before).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import yaml

from meshtron.config.loader import path_beside

TOKENIZER_DIR = "tokenizer"
# Files beside a model's weights that tokenizers, chat templates and generation settings are read from.
SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
SKIPPED_SIDE_FILES = ("model.safetensors.index.json",)


def side_files(directory: Path) -> list[Path]:
    """The small text/config files of a model or tokenizer directory (never weights or their index)."""
    return [p for p in sorted(directory.iterdir())
            if p.is_file() and p.suffix in SIDE_FILE_SUFFIXES and p.name not in SKIPPED_SIDE_FILES]


def copy_side_files(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for f in side_files(source):
        shutil.copy2(f, target / f.name)


def carry_tokenizer(tokenizer: dict[str, Any]) -> Optional[tuple[str, Callable[[Path], None]]]:
    """For a config's tokenizer section (a dict): (the path to write in the checkpoint's config, relative
    to the step directory; a function that copies the files into <step dir>/tokenizer), or None when
    there is nothing to carry (the byte tokenizer, or a path that does not exist here)."""
    path = tokenizer.get("path")
    if tokenizer.get("type") == "byte" or not path or not Path(path).exists():
        return None
    source = Path(path)
    if source.is_dir():   # an hf tokenizer directory (tokenizer.json, tokenizer_config.json, chat template)
        return TOKENIZER_DIR, lambda target: copy_side_files(source, target)

    def fill(target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        if tokenizer.get("type") == "hf":   # tokenizer.json given as a file: its tokenizer_config.json too
            copy_side_files(source.parent, target)
        shutil.copy2(source, target / source.name)

    return f"{TOKENIZER_DIR}/{source.name}", fill


def self_contained_config(config: dict[str, Any]) -> tuple[str, dict[str, Callable[[Path], None]]]:
    """(config.yaml text naming the carried tokenizer relatively, {sub-directory: fill}) of a run config dict."""
    carried = carry_tokenizer(config.get("tokenizer", {}))
    if carried is None:
        return yaml.safe_dump(config, sort_keys=False), {}
    relative, fill = carried
    config = {**config, "tokenizer": {**config["tokenizer"], "path": relative}}
    return yaml.safe_dump(config, sort_keys=False), {TOKENIZER_DIR: fill}


def resolve_tokenizer_path(path: Optional[str], step_dir: Path) -> Optional[str]:
    """The tokenizer path of a checkpoint's config as a usable path (`path_beside` the step directory)."""
    return path_beside(path, step_dir)


def checkpoint_run_config(path: str | Path, tokenizer: Optional[str] = None):
    """The RunConfig saved with a checkpoint, its tokenizer path made usable from here (see
    `resolve_tokenizer_path`), or replaced by `tokenizer` (a directory or file of the same tokenizer
    type; for a byte-tokenizer checkpoint, an hf tokenizer)."""
    from meshtron.checkpoint.manager import read_checkpoint_config, resolve_checkpoint
    from meshtron.config.fields import ConfigError
    from meshtron.config.loader import config_from_dict

    cfg = config_from_dict(yaml.safe_load(read_checkpoint_config(path)))
    if tokenizer:
        if not Path(tokenizer).exists():
            raise ConfigError(f"--tokenizer: {tokenizer!r} does not exist; give a tokenizer directory or file")
        if cfg.tokenizer.type == "byte":
            cfg.tokenizer.type = "hf"
        cfg.tokenizer.path = tokenizer
    else:
        cfg.tokenizer.path = resolve_tokenizer_path(cfg.tokenizer.path, resolve_checkpoint(path))
    return cfg
