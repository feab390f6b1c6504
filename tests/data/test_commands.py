"""The data verbs end to end through their argparse entry point: corpus stdlib, tokenizer train,
preprocess, data merge and data info; user errors give one line on stderr and exit status 2."""

from __future__ import annotations

import json

import pytest
from data_helpers import rewrite_idx, write_indexed

from meshtron.data.commands import main
from meshtron.data.corpus import STDLIB_LICENSE, stdlib_files, stdlib_root
from meshtron.data.indexed import IndexedDataset
from meshtron.data.tokenizer import build_tokenizer, tokenizer_config_for


def test_corpus_stdlib_writes_one_line_per_source_file(tmp_path, capsys):
    out = tmp_path / "stdlib.jsonl"
    assert main(["corpus", "stdlib", "--output", str(out)]) == 0
    files = stdlib_files()
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(files)
    first = json.loads(lines[0])
    assert set(first) == {"text", "path", "license"} and first["license"] == STDLIB_LICENSE
    assert first["path"] == str(files[0].relative_to(stdlib_root()))
    assert first["text"] == files[0].read_bytes().decode("utf-8", errors="replace")
    assert f"{len(files)} documents" in capsys.readouterr().out
    few = tmp_path / "few.jsonl"
    assert main(["corpus", "stdlib", "--output", str(few), "--max-documents", "3"]) == 0
    assert few.read_text(encoding="utf-8").splitlines() == lines[:3]
    assert main(["corpus", "stdlib", "--output", str(few), "--max-documents", "0"]) == 2
    assert "--max-documents" in capsys.readouterr().err


def test_train_preprocess_merge_info(tmp_path, jsonl_file, documents, capsys):
    tok_dir = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(jsonl_file), "--vocab-size", "400",
                 "--output", str(tok_dir)]) == 0
    tok = build_tokenizer(tokenizer_config_for(str(tok_dir)))
    for k, part in enumerate((documents[:15], documents[15:])):
        path = tmp_path / f"part{k}.jsonl"
        path.write_text("".join(json.dumps({"body": d}) + "\n" for d in part), encoding="utf-8")
        assert main(["preprocess", "--input", str(path), "--json-key", "body", "--tokenizer", str(tok_dir),
                     "--output-prefix", str(tmp_path / f"p{k}"), "--workers", "2", "--append-eod",
                     "--no-progress"]) == 0
    assert main(["data", "merge", "--input", str(tmp_path / "p0"), str(tmp_path / "p1"),
                 "--output-prefix", str(tmp_path / "all")]) == 0
    merged = IndexedDataset(tmp_path / "all")
    assert [merged[k].tolist() for k in range(len(merged))] == [tok.encode(d) + [tok.eod_id] for d in documents]
    capsys.readouterr()
    assert main(["data", "info", str(tmp_path / "all"), "--verify"]) == 0
    assert f"{len(documents)} documents" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["data", "info", "/nonexistent/prefix"], "not found"),
    (["preprocess", "--input", "/nonexistent", "--tokenizer", "byte", "--output-prefix", "/tmp/x"], "--input"),
    (["preprocess", "--input", "/nonexistent", "--output-prefix", "/tmp/x"], "--tokenizer"),
    (["preprocess", "--input", ".", "--tokenizer", "/nonexistent/dir", "--output-prefix", "/tmp/x"], "tokenizer.path"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and err.count("\n") == 1


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["preprocess", "--input", "x"])
    assert e.value.code == 2 and "--output-prefix" in capsys.readouterr().err


def test_module_entry_point(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "meshtron.data.commands", "data", "info", str(tmp_path / "none")],
                         capture_output=True, text=True, cwd=repo)
    assert out.returncode == 2 and out.stderr.startswith("error:")


def test_data_info_verify_reports_max_id_and_out_of_vocabulary_ids(tmp_path, capsys):
    """Issue 16: --verify scans every token (maximum id, ids >= --vocab-size / --tokenizer's vocab),
    and a .idx whose sizes disagree with its offsets is no longer reported as ok."""
    docs = [[1, 2, 3], [200, 261, 5], [7]]
    prefix = str(write_indexed(tmp_path / "a", docs, vocab_size=262).prefix)
    assert main(["data", "info", prefix]) == 0
    assert "max token id 261" in capsys.readouterr().out
    assert main(["data", "info", prefix, "--verify", "--tokenizer", "byte"]) == 0   # the byte tokenizer: 262 ids
    assert "checksum ok, all ids < 262" in capsys.readouterr().out
    for argv in (["--verify", "--vocab-size", "201"], ["--vocab-size", "201"]):  # scanned, or the recorded max
        assert main(["data", "info", prefix, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and err.count("\n") == 1 and prefix in err and "201" in err and "261" in err
    assert main(["data", "info", prefix, "--verify", "--vocab-size", "200"]) == 2
    assert "2 token ids >= vocab size 200 (maximum id 261, first in document 1)" in capsys.readouterr().err
    rewrite_idx(prefix, max_id_field=0)   # written before the maximum was recorded: a vocabulary check scans
    assert main(["data", "info", prefix]) == 0 and "max token id not recorded" in capsys.readouterr().out
    assert main(["data", "info", prefix, "--vocab-size", "201"]) == 2
    assert "first in document 1" in capsys.readouterr().err
    assert main(["data", "info", prefix, "--vocab-size", "262"]) == 0
    assert "max token id 261, checksum ok" in capsys.readouterr().out
    rewrite_idx(prefix, sizes=[2, 4, 1])  # same total, so only the offsets tell
    assert main(["data", "info", prefix, "--verify"]) == 2
    err = capsys.readouterr().err
    assert "a.idx: document 0 has size 2 but offsets 0..3" in err and err.count("\n") == 1


def test_data_info_accepts_the_prefix_or_either_file(tmp_path, capsys):
    """`data info X.bin` and `X.idx` mean the dataset X (they used to look for X.bin.bin)."""
    write_indexed(tmp_path / "ds", [[1, 2, 3], [4, 5]], vocab_size=10)
    outputs = []
    for name in ("ds", "ds.bin", "ds.idx"):
        assert main(["data", "info", str(tmp_path / name)]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2]   # each names the dataset by its prefix
    assert "2 documents, 5 tokens" in outputs[0]
    # a prefix that itself ends in .bin is still read as given
    write_indexed(tmp_path / "odd.bin", [[7]], vocab_size=10)
    assert main(["data", "info", str(tmp_path / "odd.bin")]) == 0
    assert "1 documents, 1 tokens" in capsys.readouterr().out
