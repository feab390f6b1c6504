"""The configuration reference (docs/config.md) and `meshtron config show`."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from meshtron.cli import ENGINE_SECTION, main
from meshtron.config import RunConfig, load_config
from meshtron.config.loader import config_to_dict
from meshtron.config.reference import render_reference, run_sections, undocumented_fields

ROOT = Path(__file__).resolve().parents[2]


def test_committed_reference_is_current(capsys):
    rc = main(["config", "docs", "--check", "--output", str(ROOT / "docs" / "config.md")])
    assert rc == 0, "docs/config.md is stale: run `meshtron config docs` and commit docs/config.md"


def test_every_field_is_documented_with_its_default():
    sections = [*run_sections(), ENGINE_SECTION]
    assert [s.name for s in sections[:-1]] == list(RunConfig.__dataclass_fields__)
    assert undocumented_fields(sections) == []
    rows: dict[tuple[str, str], list[str]] = {}
    section = None
    for line in render_reference(sections).splitlines():
        if line.startswith("## "):
            section = line[3:]
        elif line.startswith("| `"):
            # GitHub tables: an escaped pipe is a pipe, also inside code spans
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip("|"))]
            rows[(section, cells[0].strip("`"))] = cells
    expected = {(s.name, f.name): (s.cls(), f) for s in sections for f in dataclasses.fields(s.cls)}
    assert set(rows) == set(expected)
    for key, (instance, f) in expected.items():
        name, flag, _, default, help_text = rows[key]
        value = getattr(instance, f.name)
        assert yaml.safe_load(default.strip("`")) == (list(value) if isinstance(value, tuple) else value), key
        assert help_text == f.metadata["help"], key
    assert rows[("model", "num_layers")][1] == "`--model.num_layers`"
    assert rows[("engine", "max_num_seqs")][1] == "`--max-num-seqs`"


def test_config_show_prints_the_resolved_config_and_the_difference(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 2\n  hidden_size: 256\ntrain:\n  train_iters: 10\n")
    assert main(["config", "show", "--config", str(path), "--train.train_iters", "7", "--data.paths", "[a, b]"]) == 0
    out = capsys.readouterr().out
    resolved, _, diff = out.partition("# differences from the defaults")
    expected = config_to_dict(load_config(path, {"train.train_iters": "7", "data.paths": "[a, b]"}))
    assert yaml.safe_load(resolved) == expected
    # hidden_size 256 is the default: set in the file but not a difference
    assert diff.splitlines() == [": 3 field(s)", f"model.num_layers: 4 -> 2    ({path})",
                                 "train.train_iters: 1000 -> 7    (--train.train_iters)",
                                 "data.paths: [] -> [a, b]    (--data.paths)"]
    assert main(["config", "show", "--diff", "--parallel.tp", "3"]) == 2
    assert "parallel" in capsys.readouterr().err
