"""docs/megatron.md's argument table is generated from the config dataclasses and kept current."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from meshtron.cli import main
from meshtron.config.schema import ModelConfig
from meshtron.models.megatron.names import ARGUMENTS, config_table

ROOT = Path(__file__).resolve().parents[3]


def test_committed_table_is_current():
    rc = main(["convert", "megatron-docs", "--check", "--output", str(ROOT / "docs" / "megatron.md")])
    assert rc == 0, "docs/megatron.md is stale: run `meshtron convert megatron-docs` and commit it"


def test_every_model_field_has_a_row_and_every_mapping_names_a_field():
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    assert set(ARGUMENTS) <= set(names)
    rows = [line.split("|")[1].strip().strip("`") for line in config_table().splitlines()[2:]]
    assert rows == names
