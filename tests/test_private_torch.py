"""Private PyTorch names are used only in meshtron/compat.py (its docstring says why each is needed).

Statically, over every module of meshtron: an import from a private torch module (`torch.utils._pytree`)
or of a private name, an attribute chain from torch with a private link (`torch._C...`,
`dist.distributed_c10d._get_default_store`), and any `obj._name` whose `_name` meshtron does not define
itself (so `mesh._flatten` or `opts._timeout` count, `self._lock` does not). A few private names of the
standard library (argparse's parser internals among them) are allowed by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import meshtron

PACKAGE = Path(meshtron.__file__).parent
# os._exit, sys._getframe/_current_frames, namedtuple's and enum's documented underscore names, and numpy's
# array reconstruction (the checkpoint upgrade admits it to the weights_only unpickler by identity)
ALLOWED_FOREIGN = {"_exit", "_getframe", "_current_frames", "_asdict", "_replace", "_fields", "_make",
                   "_value_", "_name_", "_missing_", "_reconstruct"}
# argparse's parser internals, read by config/flags.py to print one command's help and spell flags two ways
# (unchanged since Python 3.2; shtab and argcomplete read the same ones)
ALLOWED_FOREIGN |= {"_actions", "_action_groups", "_group_actions", "_option_string_actions",
                    "_mutually_exclusive_groups", "_get_formatter", "_format_args", "_print_message",
                    "_ArgumentGroup", "_SubParsersAction"}
TORCH_ROOTS = {"torch", "dist", "F", "nn", "dcp"}


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(f, ast.parse(f.read_text())) for f in sorted(PACKAGE.rglob("*.py"))]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(modules) -> set[str]:
    """The private attribute names meshtron defines on its own objects: methods and class-level names,
    attributes it assigns (`self._x = ...`), and keyword arguments (dataclass fields set by name)."""
    names: set[str] = set()
    for _, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        names.update(t.id for t in item.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _chain(node: ast.AST) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def private_torch_uses() -> list[str]:
    modules = _modules()
    own = _own_names(modules)
    found = []
    for path, tree in modules:
        if path.name == "compat.py" and path.parent == PACKAGE:
            continue
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
                names = node.module.split(".") + [a.name for a in node.names]
                if any(_private(n) for n in names):
                    found.append(f"{where}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                chain = _chain(node)
                from_torch = bool(chain) and chain[0] in TORCH_ROOTS
                if from_torch or (node.attr not in own and node.attr not in ALLOWED_FOREIGN):
                    found.append(f"{where}:{node.lineno}: .{node.attr}")
    return found


def test_private_torch_names_only_in_compat():
    found = private_torch_uses()
    assert not found, "private PyTorch names outside meshtron/compat.py (add a function there):\n" + "\n".join(found)


def test_the_check_sees_a_private_use():
    # the scan is not vacuous: each kind of use in a probe module is reported
    bad = PACKAGE / "_private_probe_tmp.py"
    bad.write_text("import torch\nfrom torch.utils._pytree import tree_map\n"
                   "def f(mesh):\n    return torch._C._foo(), mesh._flatten('x')\n")
    try:
        found = [f for f in private_torch_uses() if "_private_probe_tmp" in f]
    finally:
        bad.unlink()
    assert len(found) == 4, found  # the import, torch._C, torch._C._foo, mesh._flatten
