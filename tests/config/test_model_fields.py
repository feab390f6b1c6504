"""Architecture fields of ModelConfig: the int-or-list window_attn_skip_freq in every spelling, which
layers it windows, and one-line errors naming the field for bad values."""

from __future__ import annotations

import pytest
import yaml

from meshtron.config import ConfigError, config_from_dict, config_to_dict, load_config


@pytest.mark.parametrize("text,expected", [("2", 2), ("[1, 0, 1, 0]", [1, 0, 1, 0]), ("1,0,1,0", [1, 0, 1, 0]),
                                           ("null", None)])
def test_window_attn_skip_freq_int_or_list(text, expected):
    cfg = load_config(overrides={"model.window_size": "8", "model.window_attn_skip_freq": text})
    assert cfg.model.window_attn_skip_freq == expected
    assert config_from_dict(config_to_dict(cfg)).model.window_attn_skip_freq == expected


def test_window_attn_skip_freq_from_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"window_size": 4, "window_attn_skip_freq": [1, 1, 0, 1]}}))
    assert load_config(path).model.window_attn_skip_freq == [1, 1, 0, 1]


def test_which_layers_are_windowed():
    every_third = load_config(overrides={"model.num_layers": "6", "model.window_size": "8",
                                         "model.window_attn_skip_freq": "3"}).model
    assert [every_third.is_window_layer(i) for i in range(6)] == [True, True, False, True, True, False]
    listed = load_config(overrides={"model.window_size": "8", "model.window_attn_skip_freq": "0,1,1,0"}).model
    assert [listed.is_window_layer(i) for i in range(4)] == [False, True, True, False]
    unwindowed = load_config(overrides={"model.window_attn_skip_freq": "2"}).model
    assert not any(unwindowed.is_window_layer(i) for i in range(4))


BAD = [
    ({"model.window_attn_skip_freq": "abc"}, "model.window_attn_skip_freq: expected int or list[int] or null, got 'abc'"),
    ({"model.window_attn_skip_freq": "[1, 0]"}, "model.window_attn_skip_freq: [1, 0] is not allowed; give one 0 (full) "
                                                "or 1 (window) per attention layer (4 of them)"),
    ({"model.window_attn_skip_freq": "0"}, "model.window_attn_skip_freq: 0 is not allowed"),
    ({"model.window_size": "0"}, "model.window_size: 0 is not allowed"),
    ({"model.softmax_type": "sparsemax"}, "model.softmax_type: 'sparsemax' is not allowed; choose one of: vanilla, "
                                          "off-by-one, learnable"),
    ({"model.rotary_percent": "0.3"}, "model.rotary_percent: 19 is not allowed; RoPE needs an even number"),
    ({"model.rope_scaling": "true", "model.position_embedding_type": "yarn"}, "model.rope_scaling: True"),
    ({"model.activation_func_clamp_value": "7", "model.activation": "gelu"}, "model.activation_func_clamp_value"),
    ({"model.multi_latent_attention": "true", "model.qk_layernorm": "true"}, "model.qk_layernorm: True is not allowed"),
    ({"model.mtp_num_layers": "-1"}, "model.mtp_num_layers: -1 is not allowed"),
    ({"model.softmax_scale": "0"}, "model.softmax_scale: 0.0 is not allowed"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_values_name_the_field_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert message in str(info.value) and "\n" not in str(info.value)
