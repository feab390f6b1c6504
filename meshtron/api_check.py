"""`meshtron check-api`: compare the package's public API with a baseline and report breaking changes.

Both sides are read from source by `griffe` (nothing is imported). The baseline is a snapshot
written at release (`api/baseline.json`, `--write-baseline`) or any git ref. The old side is cut
down to the public API (see `meshtron.api`), griffe's `find_breaking_changes` walks it against the
current package, and the findings are sorted into breaking changes (exit 1) and warnings
(changed return annotations; exit 0).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from meshtron.config.fields import ConfigError

SNAPSHOT_FORMAT = 1
EXEMPT_DECORATORS = ("internal_api", "experimental_api")
MODULE_MARKER = "__meshtron_api__"  # `__meshtron_api__ = "internal"` at module level exempts the module (package)
EXEMPT_MODULE_VALUES = ("internal", "experimental")
DEFAULT_BASELINE = "api/baseline.json"


def _griffe():
    try:
        import griffe
    except ImportError:
        raise ConfigError("check-api needs the griffe package: pip install -e '.[dev]'") from None
    return griffe


@dataclass(frozen=True)
class Change:
    """One finding: `path` names the object (and parameter), `what` the change, `old`/`new` the values."""

    path: str
    what: str
    old: str = ""
    new: str = ""
    breaking: bool = True

    def line(self) -> str:
        tag = "BREAKING" if self.breaking else "warning "
        values = f": {self.old} -> {self.new}" if self.old or self.new else ""
        return f"{tag} {self.path}: {self.what}{values}"


# ---- loading -------------------------------------------------------------------------------------

def package_root(package: str = "meshtron") -> Path:
    """The directory that holds the package directory (the repository root for meshtron)."""
    if package == "meshtron":
        import meshtron

        return Path(meshtron.__file__).resolve().parent.parent
    raise ConfigError(f"--path: give the directory that holds package {package!r}")


def load_package(package: str, root: Path) -> Any:
    """The package as griffe objects, read statically from `root/package`."""
    griffe = _griffe()
    if not (root / package).is_dir() and not (root / f"{package}.py").is_file():
        raise ConfigError(f"--path: no package {package!r} under {root}")
    return griffe.load(package, search_paths=[str(root)], allow_inspection=False, resolve_aliases=False)


def load_baseline(spec: str, package: str, root: Path) -> Any:
    """A snapshot file (written by `write_baseline`) or, when no such file exists, a git ref of `root`."""
    griffe = _griffe()
    path = Path(spec) if Path(spec).is_absolute() else Path.cwd() / spec
    if not path.is_file() and (root / spec).is_file():
        path = root / spec
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"--baseline: {path} is not valid JSON ({e}); write a new one with --write-baseline") from None
        if not isinstance(data, dict) or data.get("format") != SNAPSHOT_FORMAT or data.get("package") != package:
            raise ConfigError(f"--baseline: {path} is not an API snapshot of {package!r} "
                              f"(format {SNAPSHOT_FORMAT}); write one with --write-baseline")
        module = json.loads(json.dumps(data["api"]), object_hook=lambda node: griffe.json_decoder(_restore(node)))
        collection = griffe.ModulesCollection()
        collection[package] = module
        module._modules_collection = collection  # aliases resolve against the snapshot itself
        return module
    if spec.endswith(".json"):
        raise ConfigError(f"--baseline: {path} not found; write a snapshot with `meshtron check-api --write-baseline` "
                          "or give a git ref")
    if not (root / ".git").exists():
        raise ConfigError(f"--baseline: {spec!r} is neither a file nor a git ref ({root} is not a git checkout)")
    try:
        return griffe.load_git(package, ref=spec, repo=root, allow_inspection=False, resolve_aliases=False)
    except Exception as e:  # griffe raises plain errors for unknown refs or missing packages
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--baseline: {spec!r} is neither a file nor a usable git ref ({first})") from None


# ---- which names count ---------------------------------------------------------------------------

def _decorators(obj: Any) -> list[tuple[str, ast.expr]]:
    """(last name of the decorator callable, parsed decorator expression) for a function or class."""
    out = []
    for dec in getattr(obj, "decorators", None) or []:
        text = str(dec.value)
        try:
            node = ast.parse(text, mode="eval").body
        except SyntaxError:
            continue
        func = node.func if isinstance(node, ast.Call) else node
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        out.append((name, node))
    return out


def deprecation(obj: Any) -> Optional[tuple[str, str, str]]:
    """(version, removal_version, alternative) of a `@deprecated(...)` object, else None."""
    for name, node in _decorators(obj):
        if name == "deprecated" and isinstance(node, ast.Call):
            values = [*node.args, *(k.value for k in node.keywords)]
            keys = ["version", "removal_version", "alternative"][:len(node.args)] + [k.arg for k in node.keywords]
            try:
                parsed = {k: ast.literal_eval(v) for k, v in zip(keys, values)}
            except ValueError:
                continue
            return parsed.get("version", ""), parsed.get("removal_version", ""), parsed.get("alternative", "")
    return None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in str(text).split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _module_stability(module: Any) -> str:
    """The value of a module-level `__meshtron_api__ = "internal"` (or "experimental"), else ''."""
    attr = module.members.get(MODULE_MARKER)
    if attr is None or attr.is_alias or not attr.is_attribute or attr.value is None:
        return ""
    try:
        value = ast.literal_eval(str(attr.value))
    except (ValueError, SyntaxError):
        return ""
    return value if value in EXEMPT_MODULE_VALUES else ""


def _in_exempt_module(obj: Any, package: str) -> bool:
    """Defined in (or is) `<package>.experimental` or a module/package marked internal or experimental."""
    node = obj
    while node is not None:
        if not node.is_alias and node.is_module and (node.path == f"{package}.experimental" or _module_stability(node)):
            return True
        node = node.parent
    return False


def is_exempt(obj: Any, package: str, version: Optional[str] = None) -> bool:
    """Outside the checked API: under `<package>.experimental` or a module marked internal/experimental,
    marked internal/experimental by decorator, or (given the current `version`) deprecated with a
    removal version already reached."""
    target = _target(obj)
    for node in {obj, target if target is not None else obj}:
        if _in_exempt_module(node, package):
            return True
    if target is None or target.is_alias or not (target.is_function or target.is_class):
        return False
    if any(name in EXEMPT_DECORATORS for name, _ in _decorators(target)):
        return True
    dep = deprecation(target)
    return bool(version and dep and dep[1] and _version_tuple(version) >= _version_tuple(dep[1]))


def _target(obj: Any) -> Any:
    """The object an alias points to (None when it cannot be resolved), or the object itself."""
    if not obj.is_alias:
        return obj
    try:
        return obj.final_target
    except Exception:  # an alias to another package, or to something that no longer exists
        return None


def _public_paths(root: Any, package: str, version: Optional[str]) -> set[str]:
    """Paths to keep: every public, non-exempt name, plus whatever public aliases point at."""
    keep: set[str] = set()
    seen: set[str] = set()

    def add_with_parents(path: str) -> None:
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            keep.add(".".join(parts[:i]))

    def walk(obj: Any) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        for member in list(obj.members.values()):
            if not member.is_public or is_exempt(member, package, version):
                continue
            keep.add(member.path)
            target = _target(member)
            if target is None:
                continue
            if member.is_alias:
                if not target.path.startswith(package + ".") and target.path != package:
                    continue  # a re-exported name from another package: not ours to check
                add_with_parents(target.path)
            if target.is_module or target.is_class:
                walk(target)

    keep.add(root.path)
    walk(root)
    return keep


def _prune(obj: Any, keep: set[str]) -> None:
    for name in list(obj.members):
        member = obj.members[name]
        if member.path not in keep:
            del obj.members[name]
        elif not member.is_alias and (member.is_module or member.is_class):
            _prune(member, keep)


def public_api(module: Any, package: str, version: Optional[str] = None) -> Any:
    """Cut `module` (in place) down to its public API and return it."""
    _prune(module, _public_paths(module, package, version))
    return module


# ---- snapshot ------------------------------------------------------------------------------------

# Not part of compatibility: griffe does not compare attribute values, and imports only matter for
# resolving expressions, which the snapshot stores as text.
_DROPPED_KEYS = ("docstring", "lineno", "endlineno", "analysis", "runtime", "filepath", "git_info", "source_link",
                 "imports")


def _strip(node: Any) -> Any:
    """Drop what does not matter for compatibility (docstrings, line numbers, file paths) to keep the
    snapshot small and its diffs readable; `_restore` puts back the keys griffe's decoder needs."""
    if isinstance(node, dict):
        out = {k: _strip(v) for k, v in node.items() if k not in _DROPPED_KEYS}
        if out.get("kind") == "attribute":
            out.pop("value", None)
        if out.get("kind") == "function":
            for param in out.get("parameters", []):
                if isinstance(param.get("default"), str):
                    param["default"] = normalize_default(param["default"])
        if isinstance(out.get("members"), dict):  # a list: a member named 'cls' or 'kind' would confuse the decoder
            out["members"] = list(out["members"].values())
        return out
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


_OBJECT_KINDS = ("module", "class", "function", "attribute", "alias", "type alias")


def _restore(node: dict[str, Any]) -> dict[str, Any]:
    if node.get("kind") in _OBJECT_KINDS and "name" in node:
        node.setdefault("lineno", None)
        if isinstance(node.get("members"), list):
            node["members"] = {member.name: member for member in node["members"]}
        for dec in node.get("decorators", []):
            dec.setdefault("lineno", None)
            dec.setdefault("endlineno", None)
    return node


def _plain(value: Any) -> Any:
    """griffe's dictionary form made JSON-ready, with every expression (annotation, default, base,
    decorator) as its source text rather than a tree of nodes."""
    griffe = _griffe()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, set):
        return sorted(_plain(v) for v in value)
    if isinstance(value, griffe.Expr):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    if hasattr(value, "as_dict"):
        return _plain(value.as_dict(full=False))
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def snapshot(package: str, root: Path) -> dict[str, Any]:
    module = public_api(load_package(package, root), package)
    api = _strip(_plain(module.as_dict(full=False)))
    return {"format": SNAPSHOT_FORMAT, "package": package, "version": package_version(module), "api": api}


def write_baseline(path: Path, package: str, root: Path) -> dict[str, Any]:
    data = snapshot(package, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_dump(data) + "\n")
    return data


def _dump(node: Any, indent: str = "") -> str:
    """JSON with one line per function, attribute or alias, so that a refreshed snapshot diffs readably."""
    if isinstance(node, dict) and ("members" in node or "api" in node):
        inner = indent + " "
        items = [f"{inner}{json.dumps(k)}: {_dump(v, inner)}" for k, v in node.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(node, list) and any(isinstance(v, dict) and "kind" in v for v in node):
        inner = indent + " "
        return "[\n" + ",\n".join(inner + _dump(v, inner) for v in node) + "\n" + indent + "]"
    return json.dumps(node, separators=(", ", ": "))


def package_version(module: Any) -> Optional[str]:
    """`__version__` of the package as written in its `__init__.py` (read statically)."""
    attr = module.members.get("__version__")
    value = getattr(attr, "value", None)
    if value is None:
        return None
    try:
        return str(ast.literal_eval(str(value)))
    except (ValueError, SyntaxError):
        return None


# ---- comparison ----------------------------------------------------------------------------------

def _default_text(param: Any) -> str:
    return normalize_default(str(param.default)) if param is not None and param.default is not None else ""


def normalize_default(text: str) -> str:
    """A default as source text; a config field's `option(value, help)` or `field(default=value)` reads as
    value, so that editing a help string is not a changed default."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return text
    if isinstance(node, ast.Call):
        name = getattr(node.func, "id", getattr(node.func, "attr", ""))
        if name == "option" and node.args:
            return ast.unparse(node.args[0])
        if name == "field":
            for kw in node.keywords:
                if kw.arg == "default":
                    return ast.unparse(kw.value)
                if kw.arg == "default_factory":
                    return ast.unparse(kw.value) + "()"
    return text


def _param_text(param: Any) -> str:
    if param is None:
        return ""
    text = param.name
    if param.annotation is not None:
        text += f": {param.annotation}"
    if param.default is not None:
        text += f" = {_default_text(param)}"
    return text


def _convert(breakage: Any) -> Optional[Change]:
    """A griffe breakage as a Change, or None when it is not one (a config field's help text edited)."""
    kind = breakage.kind.name
    obj_path = breakage.obj.path
    old, new = breakage.old_value, breakage.new_value
    if kind.startswith("PARAMETER_"):
        param = old if old is not None else new
        path = f"{obj_path}({param.name})"
        if kind == "PARAMETER_CHANGED_DEFAULT":
            before, after = _default_text(old), _default_text(new)
            if before == after:
                return None
            return Change(path, "default changed", before, after)
        if kind == "PARAMETER_MOVED":
            return Change(path, "positional parameter moved", "", breakage.details)
        if kind == "PARAMETER_CHANGED_KIND":
            return Change(path, "parameter kind changed", str(old.kind.value), str(new.kind.value))
        if kind == "PARAMETER_REMOVED":
            return Change(path, "parameter removed", _param_text(old), "")
        if kind == "PARAMETER_CHANGED_REQUIRED":
            return Change(path, "optional parameter became required", _param_text(old), _param_text(new))
        if kind == "PARAMETER_ADDED_REQUIRED":
            return Change(path, "parameter added without a default", "", _param_text(new))
    if kind == "OBJECT_REMOVED":
        return Change(obj_path, f"{breakage.obj.kind.value} removed")
    if kind == "OBJECT_CHANGED_KIND":
        return Change(obj_path, "kind changed", str(getattr(old, "value", old)), str(getattr(new, "value", new)))
    if kind == "RETURN_CHANGED_TYPE":
        return Change(obj_path, "return annotation removed", str(old), str(new) if new is not None else "none",
                      breaking=False)
    if kind == "CLASS_REMOVED_BASE":
        names = lambda bases: ", ".join(str(b) for b in bases)  # noqa: E731
        return Change(obj_path, "base class removed", names(old), names(new))
    return Change(obj_path, str(breakage.kind.value), str(old), str(new))


def _return_changes(old: Any, new: Any, seen: set[str]) -> list[Change]:
    """Warnings for functions whose return annotation changed (griffe only reports a removed one)."""
    out: list[Change] = []
    for name, old_member in old.members.items():
        if not old_member.is_public or name not in new.all_members:
            continue
        old_t, new_t = _target(old_member), _target(new.all_members[name])
        if old_t is None or new_t is None or old_t.path in seen:
            continue
        seen.add(old_t.path)
        if old_t.is_function and new_t.is_function:
            if old_t.returns is not None and new_t.returns is not None and str(old_t.returns) != str(new_t.returns):
                out.append(Change(old_t.path, "return annotation changed", str(old_t.returns), str(new_t.returns),
                                  breaking=False))
        elif old_t.kind == new_t.kind and (old_t.is_module or old_t.is_class):
            out.extend(_return_changes(old_t, new_t, seen))
    return out


def compare(old: Any, new: Any, package: str) -> list[Change]:
    """Breaking changes and warnings of `new` against `old`, exempt and private names skipped."""
    griffe = _griffe()
    public_api(old, package, version=package_version(new))
    changes = [c for c in map(_convert, griffe.find_breaking_changes(old, new)) if c is not None]
    changes += _return_changes(old, new, set())
    unique = {(c.path, c.what): c for c in changes}
    return sorted(unique.values(), key=lambda c: (not c.breaking, c.path, c.what))


def check(baseline: str, package: str = "meshtron", root: Optional[Path] = None) -> list[Change]:
    root = root or package_root(package)
    old = load_baseline(baseline, package, root)
    return compare(old, load_package(package, root), package)


# ---- command line ------------------------------------------------------------------------------------

def cmd_check_api(args: Any) -> int:
    root = Path(args.path).resolve() if args.path else package_root(args.package)
    if args.write_baseline is not None:
        target = Path(args.write_baseline or root / DEFAULT_BASELINE).resolve()
        data = write_baseline(target, args.package, root)
        print(f"wrote the public API of {args.package} {data['version'] or ''} to {target}")
        return 0
    baseline = args.baseline or str(root / DEFAULT_BASELINE)
    changes = check(baseline, args.package, root)
    for change in changes:
        print(change.line())
    breaking = sum(c.breaking for c in changes)
    warnings = len(changes) - breaking
    summary = f"check-api: {args.package} against {args.baseline or DEFAULT_BASELINE}: {breaking} breaking, {warnings} warning(s)"
    if breaking:
        summary += ("\nKeep the old name working (meshtron.api.deprecated), make the change compatible, or, for a "
                    "planned break, refresh the snapshot: meshtron check-api --write-baseline (docs/api.md)")
    print(summary)
    return 1 if breaking else 0


def register(sub: Any) -> None:
    p = sub.add_parser("check-api", help="report breaking changes of the public API against a baseline",
                       description="Compare the public API (every public name outside meshtron.experimental, less "
                                   "@internal_api/@experimental_api) with a snapshot or git ref. Exit 1 on breaking "
                                   "changes; changed return annotations are warnings.")
    p.add_argument("--baseline", default=None, metavar="REF_OR_FILE",
                   help=f"snapshot file or git ref (tag, branch, commit) to compare with (default {DEFAULT_BASELINE})")
    p.add_argument("--write-baseline", nargs="?", const="", default=None, metavar="FILE",
                   help=f"write the current public API as the new snapshot (default file {DEFAULT_BASELINE}) and exit")
    p.add_argument("--package", default="meshtron", help="package to check (default meshtron)")
    p.add_argument("--path", default=None, help="directory holding the package (default: where meshtron is imported "
                                                "from); also the git repository for a ref baseline")
    p.set_defaults(func=cmd_check_api)
