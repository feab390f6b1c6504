"""Hybrid layer patterns: derived from ratios (counts and even spacing), overridden by a given pattern,
and one-line errors for bad symbols, ratios and counts."""

from __future__ import annotations

import pytest

from meshtron.config import ConfigError, load_config
from meshtron.config.hybrid import pattern_from_ratios


@pytest.mark.parametrize("n,attention,mlp,expected", [
    (8, 0.25, 0.25, "M-*MM-*M"),
    (10, 0.2, 0.0, "MM*MMMM*MM"),
    (4, 0.0, 0.0, "MMMM"),
    (6, 0.5, 0.5, "-*-*-*"),
    (5, 1.0, 0.0, "*****"),
    (12, 1 / 12, 0.5, "-M-M-M*-M-M-"),
])
def test_pattern_from_ratios(n, attention, mlp, expected):
    pattern = pattern_from_ratios(n, attention, mlp)
    assert pattern == expected
    assert (pattern.count("*"), pattern.count("-")) == (round(n * attention), round(n * mlp))


def test_config_derives_the_pattern_and_a_given_pattern_overrides_it():
    derived = load_config(overrides={"model.hybrid_num_sublayers": "8", "model.hybrid_attention_ratio": "0.25",
                                     "model.hybrid_mlp_ratio": "0.25"}).model
    assert derived.pattern == "M-*MM-*M"
    override = load_config(overrides={"model.hybrid_num_sublayers": "4", "model.hybrid_attention_ratio": "0.25",
                                      "model.layer_pattern": "*M-M"}).model
    assert override.pattern == "*M-M"
    assert load_config().model.pattern == "*-" * 4  # no hybrid: num_layers transformer layers


BAD = [
    ({"model.layer_pattern": "M*X-"}, "model.layer_pattern: 'M*X-' is not allowed; unknown symbol(s) ['X'] (first "
                                      "at index 2); use '*' attention, '-' dense MLP, 'M' Mamba-2"),
    ({"model.hybrid_num_sublayers": "4", "model.layer_pattern": "M*M"},
     "model.layer_pattern: 'M*M' is not allowed; has 3 sublayers but hybrid_num_sublayers=4"),
    ({"model.hybrid_num_sublayers": "4", "model.hybrid_attention_ratio": "0.5", "model.hybrid_mlp_ratio": "0.75"},
     "model.hybrid_mlp_ratio: 0.75 is not allowed; with hybrid_attention_ratio=0.5 it asks for 2 attention + 3 MLP"),
    ({"model.hybrid_attention_ratio": "1.5"}, "model.hybrid_attention_ratio: 1.5 is not allowed; must be in [0, 1]"),
    ({"model.hybrid_num_sublayers": "0"}, "model.hybrid_num_sublayers: 0 is not allowed"),
    ({"model.layer_pattern": "M-", "model.mamba_num_groups": "3"}, "model.mamba_num_groups: 3 is not allowed; must "
                                                                   "divide the 8 Mamba heads"),
    ({"model.layer_pattern": "M-", "model.mamba_head_dim": "100"}, "model.mamba_head_dim: 100 is not allowed; must "
                                                                   "divide mamba_expand * hidden_size = 512"),
    ({"model.layer_pattern": "M", "model.mamba_dt_limit_min": "0.2", "model.mamba_dt_limit_max": "0.1"},
     "model.mamba_dt_limit_min: 0.2 is not allowed"),
    ({"model.layer_pattern": "M-", "parallel.cp": "2"}, "parallel.cp: 2 is not allowed; context parallelism splits "
                                                        "the sequence, which Mamba sublayers"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_hybrid_settings_name_the_field_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides, world_size=2 if "parallel.cp" in overrides else 1)
    assert message in str(info.value) and "\n" not in str(info.value)
