"""Config: YAML + dotted overrides, one-line errors with exit status 2, generated --help."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from meshtron.cli import main
from meshtron.config import ConfigError, config_from_dict, config_to_dict, load_config


def test_defaults_yaml_and_overrides_merge_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"hidden_size": 64, "num_layers": 3},
                                    "train": {"train_iters": 7}, "data": {"paths": ["a", "b"]}}))
    cfg = load_config(path, {"train.train_iters": "9", "model.num_query_groups": "null",
                             "optimizer.lr": "2e-3", "data.reset_attention_mask": "true"})
    assert cfg.model.hidden_size == 64 and cfg.model.num_layers == 3          # from YAML
    assert cfg.train.train_iters == 9                                        # CLI beats YAML
    assert cfg.optimizer.lr == 2e-3 and cfg.data.reset_attention_mask is True
    assert cfg.model.num_query_groups is None
    assert cfg.data.paths == ["a", "b"]
    assert cfg.train.micro_batch_size == 8                                   # default untouched
    assert cfg.model.pattern == "*-*-*-"


def test_list_override_forms():
    assert load_config(overrides={"data.paths": "x,y"}).data.paths == ["x", "y"]
    assert load_config(overrides={"data.paths": "[x, y, z]"}).data.paths == ["x", "y", "z"]
    assert load_config(overrides={"train.debug_nonfinite_steps": "[3, 4]"}).train.debug_nonfinite_steps == [3, 4]


def test_round_trip_through_dict():
    cfg = load_config(overrides={"model.layer_pattern": "*-*", "train.seed": "7"})
    assert config_to_dict(config_from_dict(config_to_dict(cfg))) == config_to_dict(cfg)


BAD = [
    ({"model.hidden_size": "abc"}, "model.hidden_size: expected an integer, got 'abc'"),
    ({"model.normalization": "BatchNorm"}, "model.normalization: 'BatchNorm' is not allowed; choose one of: RMSNorm, LayerNorm"),
    ({"model.layer_pattern": "*-X"}, "model.layer_pattern"),
    ({"model.num_attention_heads": "5"}, "model.num_attention_heads: 5 is not allowed; must divide hidden_size=256"),
    ({"model.num_query_groups": "3"}, "model.num_query_groups: 3 is not allowed; must divide num_attention_heads=4"),
    ({"model.hidden_dropout": "1.5"}, "model.hidden_dropout: 1.5 is not allowed; must be in [0, 1)"),
    ({"optimizer.lr": "-1"}, "optimizer.lr: -1.0 is not allowed; must be > 0"),
    ({"optimizer.type": "lion"}, "optimizer.type: 'lion' is not allowed; choose one of: adam, sgd"),
    ({"optimizer.clip_grad": "-0.5"}, "optimizer.clip_grad"),
    ({"scheduler.decay_style": "step"}, "scheduler.decay_style"),
    ({"scheduler.warmup_steps": "-3"}, "scheduler.warmup_steps"),
    ({"train.micro_batch_size": "0"}, "train.micro_batch_size"),
    ({"train.global_batch_size": "10", "train.micro_batch_size": "4"},
     "train.global_batch_size: 10 is not allowed; must be a multiple of train.micro_batch_size=4"),
    ({"train.precision": "fp8"}, "train.precision"),
    ({"train.eval_iters": "0"}, "train.eval_iters"),
    ({"data.seq_length": "4096"}, "data.seq_length: 4096 is not allowed; must be <= model.max_position_embeddings=2048"),
    ({"data.split": "a,b"}, "data.split"),
    ({"checkpoint.keep_last": "-1"}, "checkpoint.keep_last"),
    ({"logger.log_interval": "0"}, "logger.log_interval"),
    ({"parallel.tp": "2"}, "parallel"),
    ({"parallel.tp": "0"}, "parallel.tp"),
    ({"train.no_such_field": "1"}, "train.no_such_field: unknown field"),
    ({"nosection.x": "1"}, "nosection: unknown section"),
    ({"logger.tensorboard": "maybe"}, "logger.tensorboard: expected true or false"),
    ({"model.ffn_hidden_size": "-5"}, "model.ffn_hidden_size: -5 is not allowed; must be >= 1 or null"),
    ({"model.kv_channels": "0"}, "model.kv_channels: 0 is not allowed; must be >= 1 or null"),
    ({"model.vocab_size": "-1"}, "model.vocab_size: -1 is not allowed; must be >= 1 or null"),
    ({"model.num_query_groups": "-2"}, "model.num_query_groups: -2 is not allowed; must be >= 1 or null"),
    ({"model.rotary_base": "-1"}, "model.rotary_base: -1.0 is not allowed; must be > 0"),
    ({"model.rotary_base": "0"}, "model.rotary_base: 0.0 is not allowed; must be > 0"),
    ({"data.seed": "-1"}, "data.seed: -1 is not allowed; must be >= 0"),
    ({"model.yarn_mscale": "-0.5"}, "model.yarn_mscale: -0.5 is not allowed; must be >= 0"),
    ({"optimizer.sgd_momentum": "1"}, "optimizer.sgd_momentum: 1.0 is not allowed; must be in [0, 1)"),
    ({"scheduler.min_lr": "0.01", "optimizer.lr": "0.001"},
     "scheduler.min_lr: 0.01 is not allowed; must be <= optimizer.lr=0.001"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(BAD)])
def test_bad_value_exits_2_with_one_line(overrides, message, capsys):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)
    argv = ["train"] + [x for k, v in overrides.items() for x in (f"--{k}", v)]
    assert main(argv) == 2
    err_text = capsys.readouterr().err
    # unknown flags are rejected by the generated parser itself, which names the flag
    expected = next(iter(overrides)) if "unknown" in message else message
    assert err_text.count("\n") == 1 and err_text.startswith("error: ") and expected in err_text


def test_bad_yaml_files(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("modle:\n  hidden_size: 3\n")
    assert main(["train", "--config", str(unknown)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "modle: unknown section" in err


def test_unknown_flag_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "meshtron", "train", "--bogus", "1"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "unrecognized arguments: --bogus" in proc.stderr


def test_help_all_lists_every_field_with_type_default_and_help():
    from meshtron.config.loader import COMMAND_SECTIONS

    proc = subprocess.run([sys.executable, "-m", "meshtron", "train", "--help-all"], capture_output=True, text=True)
    assert proc.returncode == 0
    out = " ".join(proc.stdout.split())
    cfg = load_config()
    for section, fields in config_to_dict(cfg).items():
        for name in fields:
            assert (f"--{section}.{name}" in out) == (section in COMMAND_SECTIONS["train"])
    assert "Query heads per attention sublayer [int; default: 4]" in out
    assert "Decay after warmup [one of: cosine, linear, constant, WSD; default: 'cosine']" in out


def test_resolved_config_written_to_run_dir(tiny_config):
    from meshtron.training import Trainer

    cfg = tiny_config(**{"train.train_iters": "1", "checkpoint.save_at_end": "false"})
    Trainer(cfg).train()
    saved = yaml.safe_load(open(f"{cfg.train.run_dir}/config.yaml"))
    assert saved == config_to_dict(cfg)


def test_a_relative_tokenizer_path_is_found_next_to_the_config_file(tmp_path, monkeypatch):
    """A checkpoint's config.yaml names its carried tokenizer relatively: `--config` of that file from
    another directory reads the tokenizer next to it, also when the working directory has one of that name."""
    step = tmp_path / "ckpt" / "step_00000010"
    (step / "tokenizer").mkdir(parents=True)
    (step / "config.yaml").write_text("tokenizer:\n  type: hf\n  path: tokenizer\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_config(step / "config.yaml", validate=False).tokenizer.path == str(step / "tokenizer")
    (elsewhere / "tokenizer").mkdir()
    assert load_config(step / "config.yaml", validate=False).tokenizer.path == str(step / "tokenizer")
    (step / "config.yaml").write_text("tokenizer:\n  type: hf\n  path: ../../elsewhere/tokenizer\n")
    assert load_config(step / "config.yaml", validate=False).tokenizer.path == "../../elsewhere/tokenizer"
