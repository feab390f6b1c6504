"""Build a `RunConfig` from YAML and dotted overrides, and generate the CLI from the dataclasses.

Precedence: dataclass defaults < YAML file < `--section.field value` overrides. Values are parsed
as YAML scalars/lists (`--data.paths '[a, b]'` or `a,b`) and coerced to the declared field type.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

import yaml

from meshtron.config.fields import ConfigError, coerce, field_types, type_name
from meshtron.config.schema import SECTIONS, RunConfig


def _section_classes() -> dict[str, type]:
    return {name: tp for name, tp in field_types(RunConfig).items()}


def _assign(cfg: RunConfig, section: str, name: str, raw: Any) -> None:
    classes = _section_classes()
    if section not in classes:
        raise ConfigError(f"{section}: unknown section; sections are: {', '.join(SECTIONS)}")
    types = field_types(classes[section])
    if name not in types:
        raise ConfigError(f"{section}.{name}: unknown field; {section} has: {', '.join(types)}")
    setattr(getattr(cfg, section), name, coerce(raw, types[name], f"{section}.{name}"))


def _parse_scalar(text: str) -> Any:
    """Parse a command-line value as YAML so that `2`, `true`, `null` and `[a, b]` mean what they say."""
    if text.lower() in ("on", "off", "yes", "no"):
        return text  # YAML 1.1 would turn these into booleans; bool fields accept the words themselves
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _is_text_field(section: str, name: str, text: str) -> bool:
    """A str field (or a list[str] given as 'a,b') takes a flag's text as is: YAML would read '2:4' as 124."""
    cls = _section_classes().get(section)
    tp = field_types(cls).get(name) if cls is not None else None
    if text.lower() in ("null", "none") or text.lstrip().startswith("["):
        return False
    return tp is str or tp == Optional[str] or tp == list[str]


def load_config(path: str | Path | None = None, overrides: dict[str, str] | None = None,
                world_size: int | None = None) -> RunConfig:
    """Defaults, then the YAML file at `path`, then `overrides` ({'section.field': 'text'}); validated."""
    cfg = RunConfig()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: file {str(p)!r} not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config: {p} is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--config: {p} must hold a mapping of sections, got {type(data).__name__}")
        for section, fields in data.items():
            if section not in SECTIONS:
                raise ConfigError(f"{section}: unknown section in {p}; sections are: {', '.join(SECTIONS)}")
            if not isinstance(fields, dict):
                raise ConfigError(f"{section}: expected a mapping of fields in {p}, got {fields!r}")
            for name, value in fields.items():
                _assign(cfg, section, name, value)
    for key, text in (overrides or {}).items():
        if "." not in key:
            raise ConfigError(f"--{key}: overrides are --section.field value, e.g. --train.train_iters 100")
        section, name = key.split(".", 1)
        _assign(cfg, section, name, text if _is_text_field(section, name, text) else _parse_scalar(text))
    cfg.validate(world_size=world_size or int(os.environ.get("WORLD_SIZE", "1")))
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Rebuild a config saved with `config_to_dict` (e.g. from a checkpoint); unknown keys are errors."""
    cfg = RunConfig()
    for section, fields in data.items():
        for name, value in fields.items():
            _assign(cfg, section, name, value)
    return cfg


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit status 2) instead of the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one `--section.field` option per config field, with type, default and help."""
    parser.add_argument("--config", default=None, help="YAML file with config sections (overridden by the flags below)")
    defaults = RunConfig()
    for section, cls in _section_classes().items():
        group = parser.add_argument_group(f"{section} ({cls.__name__})")
        for f in dataclasses.fields(cls):
            tp = field_types(cls)[f.name]
            default = getattr(getattr(defaults, section), f.name)
            group.add_argument(
                f"--{section}.{f.name}", dest=f"{section}.{f.name}", default=argparse.SUPPRESS, metavar="V",
                help=f"{f.metadata['help']} [{type_name(tp)}; default: {default!r}]".replace("%", "%%"),
            )


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    return {k: v for k, v in vars(args).items() if "." in k}
