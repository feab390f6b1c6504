"""`--dry-run` of train, distill and rl: a summary and exit 0 without building anything or writing the
run directory, or one line naming the missing path, the mesh that does not fit, or the run directory
that already holds a run."""

from __future__ import annotations

import pytest

from meshtron.cli import main
from meshtron.config import load_config
from tests.conftest import TINY

FLAGS = [arg for k, v in TINY.items() for arg in (f"--{k}", v)]


def dry(capsys, *argv: str, command: str = "train") -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([command, *FLAGS, *argv, "--dry-run"])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_dry_run_prints_a_summary_and_builds_nothing(tmp_path, capsys):
    from meshtron.parallel.plan import estimate_memory

    run = tmp_path / "run"
    code, out, err = dry(capsys, "--train.run_dir", str(run), "--world-size", "2", "--train.global_batch_size", "8")
    assert code == 0, err
    assert not run.exists()   # nothing written: no config.yaml, metrics or checkpoints
    cfg = load_config(overrides={**TINY, "train.global_batch_size": "8"}, world_size=2)
    peak = max(r["total_bytes"] for r in estimate_memory(cfg, 2))
    assert f"memory per rank (meshtron plan): {peak / 2**30:.2f} GiB" in out
    assert "mesh: world 2 = dp_replicate 1 x dp_shard 2 x cp 1 x tp 1 x pp 1" in out
    assert "2 micro-batches of 2 x 32 tokens" in out   # 8 = 2 micro-batches x 2 sequences x 2 ranks
    assert f"run dir: {run} (a new run); starts fresh" in out
    assert out.rstrip().endswith("dry run: ok; `meshtron train` without --dry-run starts the run")


@pytest.mark.parametrize("flags, field", [
    (["--data.paths", "[/nonexistent/ds]"], "data.paths"),
    (["--tokenizer.type", "hf", "--tokenizer.path", "/nonexistent/tok"], "tokenizer.path"),
    (["--train.init_from_hf", "/nonexistent/hf"], "train.init_from_hf"),
    (["--parallel.tp", "3", "--world-size", "4"], "parallel"),
    (["--train.global_batch_size", "6", "--world-size", "4"], "train.global_batch_size"),
])
def test_a_dry_run_names_the_problem_in_one_line(tmp_path, capsys, flags, field):
    code, out, err = dry(capsys, "--train.run_dir", str(tmp_path / "run"), *flags)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {field}"), err


def test_a_dry_run_checks_the_checkpoint_to_load_and_the_run_directory(tmp_path, capsys):
    code, _, err = dry(capsys, "--train.run_dir", str(tmp_path / "run"), "--checkpoint.load", str(tmp_path / "ck"))
    assert code == 1 and "does not exist" in err and err.count("\n") == 1
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    code, _, err = dry(capsys, "--train.run_dir", str(tmp_path / "run"))
    assert code == 2 and "already holds a run" in err
    code, out, _ = dry(capsys, "--train.run_dir", str(tmp_path / "run"), "--checkpoint.load", "auto")
    assert code == 0 and "(an existing run); starts fresh (no checkpoint yet)" in out


def test_world_size_belongs_to_a_dry_run(capsys):
    assert main(["train", "--world-size", "2"]) == 2
    assert "--world-size" in capsys.readouterr().err


def test_distill_and_rl_dry_runs(tmp_path, capsys):
    code, _, err = dry(capsys, "--train.run_dir", str(tmp_path / "d"), command="distill")
    assert code == 2 and err.startswith("error: teacher.load")
    code, out, err = dry(capsys, "--train.run_dir", str(tmp_path / "r"), command="rl")
    assert code == 0, err
    assert "rollout engine and reference model come on top" in out and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_llama3_8b_shaped_config_on_64_ranks(tmp_path, capsys):
    """Real size on the meta device: the published Llama-3-8B parameter count (8,030,261,248)."""
    capsys.readouterr()
    llama = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
             "ffn_hidden_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
             "tie_word_embeddings": "false", "activation": "swiglu", "normalization": "RMSNorm"}
    flags = [arg for k, v in llama.items() for arg in (f"--model.{k}", str(v))]
    code = main(["train", *flags, "--data.seq_length", "8192", "--train.micro_batch_size", "1",
                 "--train.global_batch_size", "512", "--train.precision", "bf16", "--parallel.activation_checkpoint",
                 "full", "--dry-run", "--world-size", "64", "--train.run_dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "model: 8.030B parameters, vocab 128256" in out
    assert "world 64 = dp_replicate 1 x dp_shard 64" in out
