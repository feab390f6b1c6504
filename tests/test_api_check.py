"""`meshtron check-api`: each planted breaking change in a fixture package is reported, exempt ones are not,
from a snapshot file and from a git ref alike; the decorators behave at run time."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
import warnings
from pathlib import Path

import griffe  # noqa: F401  (a dev dependency: without it the API gate must fail, not skip)
import pytest

from meshtron.api import deprecated, experimental_api, internal_api, stability  # noqa: E402
from meshtron.api_check import check, write_baseline  # noqa: E402
from meshtron.cli import main  # noqa: E402

V1 = {
    "__init__.py": """
        __version__ = "1.0"
        from fixpkg._impl import reexported
        from fixpkg.core import Widget
        __all__ = ["Widget", "reexported"]
    """,
    "_impl.py": """
        def reexported(a, b=1): ...
        def private_module_func(a): ...
    """,
    "core.py": """
        from dataclasses import dataclass
        from meshtron.api import deprecated, experimental_api, internal_api
        from meshtron.config.fields import option

        def removed_func(a): ...
        def remove_param(a, b=1): ...
        def add_required(a): ...
        def add_optional(a): ...
        def reorder(a, b): ...
        def make_required(a, b=1): ...
        def change_default(a, b=1): ...
        def change_return(a) -> int: ...
        def drop_return(a) -> int: ...
        def keyword_reorder(*, a=1, b=2): ...
        def kind_change(a, b=1): ...
        def _private(a): ...

        @internal_api
        def internal(a): ...

        @experimental_api
        def experiment(a): ...

        @deprecated("0.5", "1.0", "fixpkg.core.change_default")
        def due_for_removal(a): ...

        @deprecated("0.9", "2.0", "fixpkg.core.change_default")
        def deprecated_not_due(a): ...

        class Widget:
            def __init__(self, size: int = 3): ...
            def method(self, x): ...
            def _helper(self): ...

        class Base:
            pass

        class Gadget(Base):
            pass

        @internal_api
        class Plumbing:
            def run(self, x): ...

        @dataclass(kw_only=True)
        class Conf:
            first: int = option(1, "the first field")
            second: str = option("x", "the second field")
            third: float = option(0.5, "the third field")
    """,
    "experimental/__init__.py": """
        def anything(a): ...
    """,
    "wiring.py": """
        __meshtron_api__ = "internal"
        def helper(a): ...
    """,
    "tools/__init__.py": """
        __meshtron_api__ = "experimental"
    """,
    "tools/runner.py": """
        def run(a, b=1): ...
    """,
}

V2 = {
    "__init__.py": V1["__init__.py"],
    "_impl.py": """
        def reexported(a): ...
        def private_module_func(): ...
    """,
    "core.py": """
        from dataclasses import dataclass
        from meshtron.api import deprecated, experimental_api, internal_api
        from meshtron.config.fields import option

        def remove_param(a): ...
        def add_required(a, c): ...
        def add_optional(a, c=0): ...
        def reorder(b, a): ...
        def make_required(a, b): ...
        def change_default(a, b=2): ...
        def change_return(a) -> str: ...
        def drop_return(a): ...
        def keyword_reorder(*, b=2, a=1): ...
        def kind_change(a, *, b=1): ...
        def _private(): ...

        @internal_api
        def internal(): ...

        @experimental_api
        def experiment(b): ...

        class Widget:
            def __init__(self, size: int = 4): ...
            def _helper(self, extra): ...

        class Base:
            pass

        class Gadget:
            pass

        @internal_api
        class Plumbing:
            pass

        @dataclass(kw_only=True)
        class Conf:
            second: str = option("x", "the second field, help text edited")
            first: int = option(1, "the first field")
            third: float = option(0.25, "the third field")
    """,
    "experimental/__init__.py": """
        def anything(): ...
    """,
    "wiring.py": """
        __meshtron_api__ = "internal"
        def helper(): ...
    """,
    "tools/__init__.py": """
        __meshtron_api__ = "experimental"
    """,
    "tools/runner.py": """
        def run(b): ...
    """,
}

EXPECTED = {
    ("fixpkg.core.removed_func", "function removed", True),
    ("fixpkg.core.remove_param(b)", "parameter removed", True),
    ("fixpkg.core.add_required(c)", "parameter added without a default", True),
    ("fixpkg.core.reorder(a)", "positional parameter moved", True),
    ("fixpkg.core.reorder(b)", "positional parameter moved", True),
    ("fixpkg.core.make_required(b)", "optional parameter became required", True),
    ("fixpkg.core.change_default(b)", "default changed", True),
    ("fixpkg.core.deprecated_not_due", "function removed", True),
    ("fixpkg.core.Widget.__init__(size)", "default changed", True),
    ("fixpkg.core.Widget.method", "function removed", True),
    ("fixpkg.core.Conf.__init__(third)", "default changed", True),
    ("fixpkg.core.kind_change(b)", "parameter kind changed", True),
    ("fixpkg.core.Gadget", "base class removed", True),
    ("fixpkg._impl.reexported(b)", "parameter removed", True),  # public through fixpkg.__all__
    ("fixpkg.core.change_return", "return annotation changed", False),
    ("fixpkg.core.drop_return", "return annotation removed", False),
}


def write_package(root: Path, files: dict[str, str]) -> Path:
    if (root / "fixpkg").exists():
        shutil.rmtree(root / "fixpkg")
    for name, text in files.items():
        path = root / "fixpkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def findings(changes) -> set[tuple[str, str, bool]]:
    return {(c.path, c.what, c.breaking) for c in changes}


def test_planted_changes_are_reported_and_exempt_ones_are_not(tmp_path):
    snapshot = tmp_path / "baseline.json"
    write_baseline(snapshot, "fixpkg", write_package(tmp_path / "v1", V1))
    assert check(str(snapshot), "fixpkg", tmp_path / "v1") == []  # the snapshot equals its own source
    changes = check(str(snapshot), "fixpkg", write_package(tmp_path / "v2", V2))
    assert findings(changes) == EXPECTED
    by_path = {c.path: c for c in changes}
    assert (by_path["fixpkg.core.change_default(b)"].old, by_path["fixpkg.core.change_default(b)"].new) == ("1", "2")
    assert (by_path["fixpkg.core.Conf.__init__(third)"].old, by_path["fixpkg.core.Conf.__init__(third)"].new) == \
        ("0.5", "0.25")
    assert (by_path["fixpkg.core.change_return"].old, by_path["fixpkg.core.change_return"].new) == ("int", "str")


def test_git_ref_baseline_gives_the_same_report(tmp_path):
    repo = write_package(tmp_path / "repo", V1)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "v1"], check=True)
    subprocess.run([*git, "tag", "v1.0"], check=True)
    write_package(repo, V2)
    assert findings(check("v1.0", "fixpkg", repo)) == EXPECTED


def test_command_exit_status_and_report(tmp_path, capsys):
    snapshot = tmp_path / "snap" / "api.json"
    v1 = write_package(tmp_path / "v1", V1)
    assert main(["check-api", "--package", "fixpkg", "--path", str(v1), "--write-baseline", str(snapshot)]) == 0
    assert main(["check-api", "--package", "fixpkg", "--path", str(v1), "--baseline", str(snapshot)]) == 0
    assert "0 breaking, 0 warning(s)" in capsys.readouterr().out
    v2 = write_package(tmp_path / "v2", V2)
    assert main(["check-api", "--package", "fixpkg", "--path", str(v2), "--baseline", str(snapshot)]) == 1
    out = capsys.readouterr().out
    assert "BREAKING fixpkg.core.change_default(b): default changed: 1 -> 2" in out
    assert "warning  fixpkg.core.change_return: return annotation changed: int -> str" in out
    assert "14 breaking, 2 warning(s)" in out
    # a missing snapshot or an unknown ref is one line, exit 2
    assert main(["check-api", "--package", "fixpkg", "--path", str(v2), "--baseline", str(tmp_path / "no.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--baseline" in err and "not found" in err


def test_decorators_at_run_time():
    @deprecated("0.2", "0.4", "meshtron.somewhere.new_function")
    def old(x, y=1):
        return x + y

    with pytest.warns(DeprecationWarning, match=r"deprecated since meshtron 0\.2 and will be removed in 0\.4; "
                                                r"use meshtron\.somewhere\.new_function instead"):
        assert old(2, y=3) == 5
    assert old.__name__ == "old" and stability(old) == "deprecated"

    @deprecated("0.2", "0.4", "NewThing")
    class OldThing:
        def __init__(self, v):
            self.v = v

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert OldThing(7).v == 7
    assert len(caught) == 1 and caught[0].category is DeprecationWarning and "use NewThing instead" in str(caught[0].message)

    def f():
        return 1

    assert stability(f) == "stable"
    assert stability(internal_api(f)) == "internal" and f() == 1
    assert stability(experimental_api(lambda: 0)) == "experimental"
    with pytest.raises(TypeError, match="removal_version"):
        deprecated("0.2", "", "x")


def test_meshtron_public_api_matches_the_committed_baseline():
    root = Path(__file__).resolve().parents[1]
    changes = check(str(root / "api" / "baseline.json"), "meshtron", root)
    breaking = [c.line() for c in changes if c.breaking]
    assert not breaking, ("breaking changes of meshtron's public API against api/baseline.json:\n" + "\n".join(breaking)
                          + "\nKeep the old names working (meshtron.api.deprecated) or, for a planned break, run "
                            "`meshtron check-api --write-baseline` and commit api/baseline.json (docs/api.md)")
