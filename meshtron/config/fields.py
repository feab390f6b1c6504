"""Field metadata, type coercion and the error type shared by every config dataclass.

A field is declared once with `option(default, help)`; its annotation gives the type. The CLI
parser, the YAML loader and `--help` are all generated from these declarations.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin


class ConfigError(ValueError):
    """A user-facing configuration problem; the message is one line naming the field and the fix."""


def option(default: Any, help: str) -> Any:
    """Declare a config field with a default and a one-line help string."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def type_name(tp: Any) -> str:
    """Human-readable name of a field type, e.g. `int`, `one of: cosine, linear`, `list[str]`."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        names = " or ".join(type_name(a) for a in args if a is not type(None))
        return names + (" or null" if type(None) in args else "")
    if origin is list:
        return f"list[{type_name(get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML/CLI value to the field type or raise ConfigError naming `path`."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return coerce(value, inner[0], path)
        # int-or-list style unions: a list-looking value goes to the list member, anything else tries
        # the members in declaration order; the error names every accepted form in one line.
        listish = isinstance(value, (list, tuple)) or (isinstance(value, str) and ("," in value or "[" in value))
        for member in sorted(inner, key=lambda a: get_origin(a) is not list) if listish else inner:
            try:
                return coerce(value, member, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: expected {type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads on/off/yes/no as booleans
            spellings = ("on", "true", "yes") if value else ("off", "false", "no")
            value = next((a for a in allowed if str(a).lower() in spellings), value)
        for a in allowed:
            if value == a or str(value) == str(a):
                return a
        raise ConfigError(f"{path}: {value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")
    if origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value))
        except ValueError:
            raise ConfigError(f"{path}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unsupported config type {tp!r} at {path}")


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a config dataclass (handles `from __future__ import annotations`)."""
    return dict(_type_hints(cls))


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:  # resolving evaluates every annotation string: once per class
    return typing.get_type_hints(cls)


def check(condition: bool, path: str, value: Any, allowed: str) -> None:
    """Raise a one-line ConfigError unless `condition` holds."""
    if not condition:
        raise ConfigError(f"{path}: {value!r} is not allowed; {allowed}")
