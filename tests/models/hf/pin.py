"""The transformers version the parity tests compare against: the minimum pinned in pyproject.toml.

A missing transformers skips the parity tests (a plain install without the `hf`/`dev` extra); an
installed one older than the pin fails loudly instead of skipping, so the parity tests never vanish
silently from a dev environment.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def transformers_pins() -> list[str]:
    """Every `transformers` requirement string in pyproject.toml, e.g. ['transformers>=5.0,<6', ...]."""
    return re.findall(r'"(transformers[^"]*)"', PYPROJECT.read_text())


def pinned_minimum() -> Version:
    found = {re.search(r">=\s*([0-9][^,\s]*)", pin).group(1) for pin in transformers_pins()}
    assert len(found) == 1, f"pyproject.toml pins transformers inconsistently: {transformers_pins()}"
    return Version(found.pop())


def import_transformers():
    """transformers, or a skip when it is not installed; a failure when it is older than the pin."""
    transformers = pytest.importorskip("transformers")
    if Version(transformers.__version__) < pinned_minimum():
        pytest.fail(f"transformers {transformers.__version__} is installed but pyproject.toml needs "
                    f">={pinned_minimum()} (rope_parameters, dtype=); pip install -e '.[dev]'", pytrace=False)
    return transformers
