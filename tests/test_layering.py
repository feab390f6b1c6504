"""Imports point down the floors drawn in docs/architecture.md (its first code block, top floor first).

Every `import meshtron.x` / `from meshtron.x import ...` in meshtron/, at module level or inside a
function, must name the importer's own package or a package on a lower floor. Two packages on one
floor are siblings and must not import each other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import meshtron

PACKAGE = Path(meshtron.__file__).parent
DRAWING = PACKAGE.parent / "docs" / "architecture.md"


def floors() -> dict[str, int]:
    """package -> floor (0 = bottom), read from the drawing: each line starts with its packages."""
    block = DRAWING.read_text().split("```")[1]
    lines = [line for line in block.splitlines() if line.strip()]
    table = {}
    for level, line in enumerate(reversed(lines)):
        for name in re.match(r"^((?:[\w/.]+\s{1,2})+)", line + "  ").group(1).split():
            table[name.removesuffix("/").removesuffix(".py").replace("/", ".")] = level
    return table


def package_of(module: str, table: dict[str, int]) -> str | None:
    """The drawn package a meshtron module belongs to (the longest drawn prefix), e.g. models.hf.llama -> models.hf."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in table:
            return ".".join(parts[:n])
    return None


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "meshtron":
                found += [(node.lineno, f"meshtron.{a.name}") for a in node.names]
            elif node.module.startswith("meshtron."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("meshtron.")]
    return found


def violations() -> list[str]:
    table = floors()
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("meshtron", *path.relative_to(PACKAGE).with_suffix("").parts))
        source = package_of(module.removesuffix(".__init__"), table)
        if source is None:
            assert path.parent == PACKAGE and path.name == "__init__.py", f"{module} is on no floor of the drawing"
            continue
        for lineno, target_module in imports(path):
            target = package_of(target_module, table)
            if target is None or target == source:
                continue
            if table[target] >= table[source]:
                side = "up" if table[target] > table[source] else "sideways"
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {source} imports {target_module} ({side})")
    return bad


def test_every_package_is_drawn():
    table = floors()
    for path in PACKAGE.iterdir():
        name = path.name.removesuffix(".py")
        if name.startswith("_") and name != "__main__" or path.name == "__pycache__" or not (
                path.is_dir() or path.suffix == ".py"):
            continue
        assert name in table, f"meshtron/{path.name} is missing from the drawing in docs/architecture.md"


def test_imports_point_down():
    bad = violations()
    assert not bad, "imports against the floors of docs/architecture.md:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import():
    probe = PACKAGE / "nn" / "_layering_probe_tmp.py"
    probe.write_text("def f():\n    from meshtron.training import trainer\n    import meshtron.rl.grpo\n")
    try:
        found = [v for v in violations() if "_layering_probe_tmp" in v]
    finally:
        probe.unlink()
    assert len(found) == 2, found
