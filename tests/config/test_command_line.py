"""The command line's conventions (issue 24): help per command, refused foreign sections, no prefix
abbreviations, kebab-case and snake_case, "did you mean", YAML line and column, booleans, --version."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from pathlib import Path

import pytest
import yaml

from meshtron.cli import build_parser, main
from meshtron.config import ConfigError, RunConfig, config_to_dict, load_config
from meshtron.config.fields import field_types
from meshtron.config.loader import overrides_from_args

ROOT = Path(__file__).resolve().parents[2]
# the sections each run command reads, written out here rather than read from the code under test
READS = {
    "train": ["model", "parallel", "optimizer", "scheduler", "train", "tokenizer", "data", "checkpoint", "logger",
              "grads", "profile"],
}
READS["rl"] = READS["train"] + ["rl", "env"]
READS["distill"] = READS["train"] + ["teacher", "distill"]
ALL_SECTIONS = list(field_types(RunConfig))


def parse(argv: list[str]):
    return build_parser().parse_args(argv)


def refused(argv: list[str], capsys) -> str:
    """The one-line error of a command line the parser refuses (exit status 2)."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def fields_of(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(field_types(RunConfig)[section])]


@pytest.mark.parametrize("command", ["train", "rl", "distill"])
def test_help_lists_only_the_sections_the_command_reads(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps at the terminal's width
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"usage: meshtron {command} ") and not lines[1].startswith(" ")  # a one-line usage
    listed = {line.split(":")[0].strip() for line in lines if line.startswith("  ") and ":" in line}
    assert set(READS[command]) <= listed and not (set(ALL_SECTIONS) - set(READS[command])) & listed
    for section in READS[command]:  # every field name is there, wrapped into the section's paragraph
        assert all(name in " ".join(out.split()) for name in fields_of(section))
    # a bound from the sections it reads: two lines per section, their field names in 60-column lines,
    # and 40 lines of the command's own flags and prose (the old help was 900+ lines)
    bound = 40 + sum(2 + math.ceil(len(", ".join(fields_of(s))) / 60) for s in READS[command])
    assert len(lines) <= bound < 400
    assert "--rl." not in out and "--teacher." not in out


@pytest.mark.parametrize("command", ["train", "rl", "distill"])
def test_help_all_shows_every_field_of_the_command_and_no_other(command, capsys):
    assert main([command, "--help-all"]) == 0
    out = capsys.readouterr().out
    for section in ALL_SECTIONS:
        present = [f"--{section}.{name} " in out or f"--{section}.{name}," in out for name in fields_of(section)]
        assert all(present) if section in READS[command] else not any(present), section


@pytest.mark.parametrize("command,argv,reader", [
    ("train", ["--rl.kl_beta", "0.5"], "meshtron rl"),
    ("train", ["--teacher.load", "/nonexistent"], "meshtron distill"),
    ("train", ["--env.names=math"], "meshtron rl"),
    ("distill", ["--rl.kl-beta", "0.5"], "meshtron rl"),
    ("rl", ["--distill.temperature", "2"], "meshtron distill"),
])
def test_a_command_refuses_the_sections_it_ignores(command, argv, reader, capsys):
    section = argv[0][2:].split(".")[0]
    err = refused([command, *argv], capsys)
    assert f"meshtron {command} does not use the {section} section; {reader} reads it" in err


def test_a_yaml_section_the_command_ignores_is_refused_unless_left_at_the_defaults(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"train_iters": 3}, "rl": {"kl_beta": 0.3}}))
    err = refused(["train", "--config", str(path)], capsys)
    assert f"rl.kl_beta: meshtron train does not use the rl section of {path}; meshtron rl reads it" in err
    with pytest.raises(ConfigError, match="does not use the rl section"):
        load_config(path, command="distill")
    assert load_config(path, command="rl").rl.kl_beta == 0.3
    assert load_config(path).rl.kl_beta == 0.3  # no command: every section (config show, plan, Python)
    # a run directory's config.yaml holds every section, the unused ones at their defaults: accepted
    saved = tmp_path / "saved.yaml"
    saved.write_text(yaml.safe_dump(config_to_dict(RunConfig())))
    assert parse(["train", "--config", str(saved)]).config == str(saved)


@pytest.mark.parametrize("config,command", [("configs/tiny.yaml", "train"), ("configs/tiny-bytes.yaml", "train"),
                                            ("configs/grpo-countdown-tiny.yaml", "rl")])
def test_shipped_configs_load_for_their_command(config, command):
    load_config(ROOT / config, command=command, validate=False)
    assert parse([command, "--config", str(ROOT / config)]).config == str(ROOT / config)


def test_misspelled_flag_gets_did_you_mean_and_the_commands_help(capsys):
    err = refused(["train", "--optimzer.lr", "1e-3"], capsys)
    assert "did you mean --optimizer.lr?" in err and "meshtron train --help" in err
    err = refused(["serve", "--checkpoint", "x", "--max-num-seq", "4"], capsys)
    assert "did you mean --max-num-seqs?" in err and "meshtron serve --help" in err


def test_misspelled_yaml_key_gets_did_you_mean_and_the_commands_help(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  lrr: 0.1\n")
    err = refused(["train", "--config", str(path)], capsys)
    assert "optimizer.lrr: unknown field; did you mean optimizer.lr?" in err and "meshtron train --help" in err
    path.write_text("optimzer:\n  lr: 0.1\n")
    assert "did you mean optimizer?" in refused(["rl", "--config", str(path)], capsys)


def test_no_prefix_abbreviations(capsys):
    err = refused(["train", "--train.train_iter", "7"], capsys)
    assert "unrecognized arguments: --train.train_iter 7; did you mean --train.train_iters?" in err
    refused(["generate", "--checkpoint", "x", "--max-new", "3"], capsys)
    refused(["config", "show", "--dif"], capsys)


def test_kebab_and_snake_case_set_the_same_field(tmp_path):
    for flag in ("--train.train-iters", "--train.train_iters"):
        cfg = load_config(overrides=overrides_from_args(parse(["train", flag, "7"])), validate=False)
        assert cfg.train.train_iters == 7
    kebab = parse(["serve", "--checkpoint", "x", "--max-num-seqs", "3", "--max-model-len", "99"])
    snake = parse(["serve", "--checkpoint", "x", "--max_num_seqs", "3", "--max_model_len", "99"])
    assert (kebab.max_num_seqs, kebab.max_model_len) == (snake.max_num_seqs, snake.max_model_len) == (3, 99)
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  micro-batch-size: 2\n")  # YAML keys too
    assert load_config(path, validate=False).train.micro_batch_size == 2


def test_yaml_syntax_error_keeps_file_line_and_column(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  train_iters: 3\n  seed: 1\n\tmicro_batch_size: 2\n")  # a tab at line 4, column 1
    err = refused(["train", "--config", str(path)], capsys)
    assert f"{path}:4:1: not valid YAML" in err and "'\\t'" in err
    path.write_text("train:\n  train_iters: 3\ndata:\n  paths: [a, b\n")  # the list opened at line 4, column 10
    with pytest.raises(ConfigError, match="started at line 4, column 10"):
        load_config(path)


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"meshtron {importlib.metadata.version('meshtron')}"


def test_booleans_are_flag_and_no_flag_with_true_false_accepted(capsys):
    def compile_of(*argv):
        return load_config(overrides=overrides_from_args(parse(["train", *argv])), validate=False).parallel.compile

    assert compile_of("--parallel.compile") is True
    assert compile_of("--parallel.compile", "true") is True
    assert compile_of("--parallel.compile", "--parallel.no_compile") is False
    assert compile_of("--parallel.no-compile") is False
    assert compile_of("--parallel.compile", "false") is False
    assert "takes no value" in refused(["train", "--parallel.no_compile", "true"], capsys)
    assert "expected true or false" in refused(["train", "--parallel.compile", "maybe"], capsys)
    serve = ["serve", "--checkpoint", "x"]
    assert parse(serve + ["--enable-prefix-caching", "false"]).enable_prefix_caching is False
    assert parse(serve + ["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse(serve + ["--cuda-graphs"]).cuda_graphs is True
    assert parse(serve + ["--cuda_graphs", "yes"]).cuda_graphs is True


def test_load_config_takes_typed_overrides():
    cfg = load_config(overrides={"train.train_iters": 7, "parallel.compile": True, "data.paths": ["a", "b"],
                                 "optimizer.lr": 2e-3, "train.micro-batch-size": 4, "train.global_batch_size": 8},
                      validate=False)
    assert (cfg.train.train_iters, cfg.parallel.compile, cfg.data.paths) == (7, True, ["a", "b"])
    assert (cfg.optimizer.lr, cfg.train.micro_batch_size) == (2e-3, 4)
    with pytest.raises(ConfigError, match="train.train_iters: expected an integer"):
        load_config(overrides={"train.train_iters": [1]})


def test_max_new_tokens_has_one_name_and_accepts_max_tokens():
    gen = ["generate", "--checkpoint", "x"]
    assert parse(gen + ["--max-tokens", "5"]).max_new_tokens == parse(gen + ["--max_new_tokens", "5"]).max_new_tokens
    assert load_config(overrides={"rl.max-new-tokens": "5"}, validate=False).rl.max_new_tokens == 5


def test_plan_defaults_the_world_size_to_the_configs_degrees(capsys):
    assert main(["plan", "--config", str(ROOT / "configs/tiny-bytes.yaml"), "--parallel.tp", "2",
                 "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1", "--train.micro_batch_size", "8"]) == 0
    assert "plan: world 4 = dp_replicate 2 x dp_shard 1 x cp 1 x tp 2 x pp 1" in capsys.readouterr().out


def test_completion_script_names_the_commands_flags(capsys):
    pytest.importorskip("shtab")
    assert main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert "--train.train_iters" in script and "--max-num-seqs" in script and "completion" in script
