"""Build a `RunConfig` from YAML and dotted overrides, and generate the CLI from the dataclasses.

Precedence: dataclass defaults < YAML file < `--section.field value` overrides. Values are parsed
as YAML scalars/lists (`--data.paths '[a, b]'` or `a,b`) and coerced to the declared field type.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import yaml

from meshtron.config.fields import ConfigError, coerce, field_types, type_name
from meshtron.config.flags import BoolFlag, OneLineParser
from meshtron.config.schema import SECTIONS, RunConfig

# The sections each run command reads; the others are refused on its command line and in its YAML.
TRAINING_SECTIONS = ("model", "parallel", "optimizer", "scheduler", "train", "tokenizer", "data", "checkpoint",
                     "logger", "grads", "profile")
COMMAND_SECTIONS = {
    "train": TRAINING_SECTIONS,
    "distill": (*TRAINING_SECTIONS, "teacher", "distill"),
    "rl": (*TRAINING_SECTIONS, "rl", "env"),
}


def commands_using(section: str) -> list[str]:
    """The run commands that read `section` (e.g. 'rl' -> ['rl'])."""
    return [c for c, sections in COMMAND_SECTIONS.items() if section in sections]


def _section_classes() -> dict[str, type]:
    return {name: tp for name, tp in field_types(RunConfig).items()}


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.7)
    return f"did you mean {close[0]}? " if close else ""


def _assign(cfg: RunConfig, section: str, name: str, raw: Any, help_hint: str = "") -> None:
    """Set one field; `help_hint` ('see meshtron train --help') ends the unknown-name errors."""
    classes = _section_classes()
    if section not in classes:
        raise ConfigError(f"{section}: unknown section; {_did_you_mean(section, classes)}sections are: "
                          f"{', '.join(SECTIONS)}" + (f" ({help_hint})" if help_hint else ""))
    types = field_types(classes[section])
    name = name.replace("-", "_")  # train-iters and train_iters are the same field
    if name not in types:
        fix = _did_you_mean(f"{section}.{name}", [f"{section}.{n}" for n in types]) or f"{section} has: {', '.join(types)} "
        raise ConfigError(f"{section}.{name}: unknown field; {fix}({help_hint or 'see docs/config.md'})")
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
    tp = field_types(cls).get(name.replace("-", "_")) if cls is not None else None
    if text.lower() in ("null", "none") or text.lstrip().startswith("["):
        return False
    return tp is str or tp == Optional[str] or tp == list[str]


def read_yaml(path: str | Path) -> Any:
    """The parsed YAML file; a missing file or a syntax error is one line with the file, line and column."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: file {str(p)!r} not found")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.MarkedYAMLError as e:
        mark, context = e.problem_mark or e.context_mark, e.context_mark
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        what = e.problem or e.context or "a syntax error"
        if e.context and e.problem and context is not None:
            what += f" ({e.context} started at line {context.line + 1}, column {context.column + 1})"
        raise ConfigError(f"--config: {where}: not valid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {p} is not valid YAML ({str(e).splitlines()[0]})") from None


def _check_used(command: str, section: str, fields: dict[str, Any], path: Path) -> None:
    """A YAML section `command` ignores is refused once it sets something; left at the defaults (as in a
    run directory's config.yaml, which holds every section) it is accepted."""
    if section in COMMAND_SECTIONS[command] or section not in SECTIONS:
        return
    default = getattr(RunConfig(), section)
    probe = dataclasses.replace(default)
    for name, value in fields.items():
        _assign_section(probe, section, name, value)
    changed = [f.name for f in dataclasses.fields(probe) if getattr(probe, f.name) != getattr(default, f.name)]
    if changed:
        users = " and ".join(f"meshtron {c}" for c in commands_using(section))
        raise ConfigError(f"{section}.{changed[0]}: meshtron {command} does not use the {section} section of {path}; "
                          f"{users} reads it: remove the section or run that command")


def _assign_section(obj: Any, section: str, name: str, value: Any) -> None:
    types = field_types(type(obj))
    key = name.replace("-", "_") if isinstance(name, str) else name
    if key in types:
        setattr(obj, key, coerce(value, types[key], f"{section}.{key}"))


def load_config(path: str | Path | None = None, overrides: Optional[Mapping[str, Any]] = None,
                world_size: int | None = None, *, command: Optional[str] = None, validate: bool = True) -> RunConfig:
    """Defaults, then the YAML file at `path`, then `overrides` ({'section.field': value}, the value a
    flag's text or a typed value: 100, True, [a, b]); validated unless `validate` is false.

    `command` ('train', 'rl' or 'distill') refuses the sections that command does not read."""
    cfg = RunConfig()
    hint = f"see meshtron {command} --help" if command else ""
    if command is not None and command not in COMMAND_SECTIONS:
        raise ValueError(f"command: {command!r} is not one of {', '.join(COMMAND_SECTIONS)}")
    if path is not None:
        p = Path(path)
        data = read_yaml(p) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"--config: {p} must hold a mapping of sections, got {type(data).__name__}")
        for section, fields in data.items():
            if section not in SECTIONS:
                raise ConfigError(f"{section}: unknown section in {p}; {_did_you_mean(str(section), SECTIONS)}"
                                  f"sections are: {', '.join(SECTIONS)}" + (f" ({hint})" if hint else ""))
            if not isinstance(fields, dict):
                raise ConfigError(f"{section}: expected a mapping of fields in {p}, got {fields!r}")
            if command is not None:
                _check_used(command, section, fields, p)
            for name, value in fields.items():
                _assign(cfg, section, str(name), value, hint)
        cfg.tokenizer.path = path_beside(cfg.tokenizer.path, p.parent)
    for key, value in (overrides or {}).items():
        if "." not in key:
            raise ConfigError(f"--{key}: overrides are --section.field value, e.g. --train.train_iters 100")
        section, name = key.split(".", 1)
        if command is not None and section in SECTIONS and section not in COMMAND_SECTIONS[command]:
            users = " and ".join(f"meshtron {c}" for c in commands_using(section))
            raise ConfigError(f"--{key}: meshtron {command} does not use the {section} section; {users} reads it")
        if isinstance(value, str) and not _is_text_field(section, name, value):
            value = _parse_scalar(value)
        _assign(cfg, section, name, value, hint)
    if validate:
        cfg.validate(world_size=world_size or int(os.environ.get("WORLD_SIZE", "1")))
    return cfg


def path_beside(path: Optional[str], directory: Path) -> Optional[str]:
    """A relative `path` that exists inside `directory` is read from there (a checkpoint's config.yaml
    names its carried tokenizer relative to itself); anything else (absolute, or relative to the working
    directory, as older checkpoints and hand-written configs name it) is returned unchanged."""
    if not path or Path(path).is_absolute():
        return path
    inside = directory / path
    if inside.exists() and inside.resolve().is_relative_to(directory.resolve()):
        return str(inside)
    return path


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


class ConfigFile(argparse.Action):
    """`--config C`: the file is read while the command line is parsed, so that a YAML error, an unknown
    key or a section the command does not read is reported (one line, exit status 2) before anything starts."""

    def __init__(self, option_strings: list[str], dest: str, command: Optional[str] = None, **kwargs: Any):
        self.command = command
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        try:  # a missing file is reported when the command loads it (it may be written by an earlier step)
            if Path(values).is_file():
                load_config(values, command=self.command, validate=False)
        except ConfigError as e:
            parser.exit(2, f"error: {e}\n")
        setattr(namespace, self.dest, values)


def add_config_arguments(parser: argparse.ArgumentParser, sections: Optional[Iterable[str]] = None,
                         command: Optional[str] = None) -> None:
    """Add `--config` and one `--section.field` option per field of `sections` (default: every
    section, or those `command` reads), with type, default and help; booleans are `--x` / `--no-x`."""
    names = list(COMMAND_SECTIONS[command] if sections is None and command else sections or SECTIONS)
    parser.add_argument("--config", default=None, metavar="C", action=ConfigFile, command=command,
                        help="YAML file with config sections (overridden by the --SECTION.FIELD flags)")
    defaults = RunConfig()
    one_line = isinstance(parser, OneLineParser)
    for section, cls in _section_classes().items():
        if section not in names:
            continue
        group = parser.add_argument_group(f"{section} ({cls.__name__})")
        for f in dataclasses.fields(cls):
            tp = field_types(cls)[f.name]
            default = getattr(getattr(defaults, section), f.name)
            help_text = f"{f.metadata['help']} [{type_name(tp)}; default: {default!r}]".replace("%", "%%")
            if tp is bool:
                group.add_argument(f"--{section}.{f.name}", dest=f"{section}.{f.name}", action=BoolFlag, as_text=True,
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(f"--{section}.{f.name}", dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                                   metavar="V", help=help_text)
        if one_line:
            parser.config_groups.append(group)
            parser.config_summary.append((section, [f.name for f in dataclasses.fields(cls)]))
    if one_line:
        parser.config_command = command
        parser.add_help_all()


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    return {k: v for k, v in vars(args).items() if "." in k}
