"""End to end through the installed entry point: train a tiny model, then generate from it."""

from __future__ import annotations

import subprocess
import sys


def test_train_then_generate(tmp_path):
    run = tmp_path / "run"
    train = subprocess.run(
        [sys.executable, "-m", "meshtron", "train", "--config", "configs/tiny-bytes.yaml", "--train.train_iters", "3",
         "--model.num_layers", "1", "--model.hidden_size", "32", "--model.ffn_hidden_size", "64",
         "--data.seq_length", "32", "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
         "--train.run_dir", str(run), "--logger.log_interval", "1", "--train.peak_flops", "1e11"],
        capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr
    assert "[train] step 3/3 | loss" in train.stdout and "done: step 3/3 in " in train.stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    gen = subprocess.run(
        [sys.executable, "-m", "meshtron", "generate", "--checkpoint", str(run / "checkpoints"), "--prompt", "def ",
         "--max-new-tokens", "20", "--seed", "1", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9"],
        capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def ")
    missing = subprocess.run([sys.executable, "-m", "meshtron", "generate", "--checkpoint", str(tmp_path / "x")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr


def test_bench_train_takes_its_own_flags(capsys):
    """`meshtron bench train --help` and leading options reach the benchmark's parser (argparse's
    REMAINDER alone would refuse them)."""
    from meshtron.cli import main

    assert main(["bench", "train", "--help"]) == 0
    assert "--repeats" in capsys.readouterr().out
    assert main(["bench", "train", "--repeats", "0"]) == 2  # the benchmark's own check, not 'unrecognized'
    err = capsys.readouterr().err
    assert "unrecognized" not in err and "--repeats" in err
