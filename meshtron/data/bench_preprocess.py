"""Benchmark of the data pipeline (benchmarks/preprocess_throughput.py runs it).

1. Tokens/s of `meshtron preprocess` (jsonl in, .bin/.idx out, N workers, end to end) on the stdlib
   corpus, against the `tokenizers` library's own `encode_batch` on the same texts already in memory,
   run in a fresh process with RAYON_NUM_THREADS=N (the same parallelism), in the same run; also
   against `encode_batch_fast` (no offsets), the like-for-like baseline, since preprocess keeps ids only.
2. Seconds to build the GPTDataset indices (document, sample, shuffle) over 100M synthetic tokens,
   and to load them back from the cache.
Runs alternate between the two sides and the best of `--repeats` is kept, which damps noise from
other work on the machine. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

DEFAULT_OUTPUT = Path("benchmarks/results/preprocess_throughput.json")


def baseline_encode(corpus: str, tokenizer_dir: str, method: str) -> dict:
    """Runs inside the baseline subprocess: time the library's batch encoder on all texts."""
    from tokenizers import Tokenizer

    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    start = time.perf_counter()
    encodings = getattr(tok, method)(texts, add_special_tokens=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "num_tokens": sum(len(e.ids) for e in encodings)}


def run_baseline(corpus: Path, tokenizer_dir: Path, num_workers: int, method: str) -> dict:
    env = {**os.environ, "RAYON_NUM_THREADS": str(num_workers), "TOKENIZERS_PARALLELISM": "true"}
    out = subprocess.run([sys.executable, "-m", "meshtron.data.bench_preprocess", "--baseline-child", str(corpus),
                          str(tokenizer_dir), method], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_meshtron(corpus: Path, tokenizer_dir: Path, num_workers: int, work: Path, k: int) -> dict:
    from meshtron.data.preprocess import PreprocessOptions, preprocess
    from meshtron.data.tokenizer import tokenizer_config_for

    opts = PreprocessOptions([str(corpus)], str(work / f"run{k}"), tokenizer_config_for(str(tokenizer_dir)),
                             num_workers=num_workers, progress=False)
    start = time.perf_counter()
    ds = preprocess(opts)
    seconds = time.perf_counter() - start
    for suffix in (".bin", ".idx"):
        Path(f"{opts.output_prefix}{suffix}").unlink()
    return {"seconds": seconds, "num_tokens": ds.num_tokens}


def write_synthetic(prefix: Path, num_tokens: int, vocab_size: int, seed: int = 0) -> int:
    """Documents of lognormal lengths (mean ~1k tokens) summing to num_tokens; returns the document count."""
    from meshtron.data.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(prefix, vocab_size)
    written = num_docs = 0
    while written < num_tokens:
        sizes = np.maximum(1, rng.lognormal(6.5, 0.8, size=10_000).astype(np.int64))
        sizes = sizes[np.cumsum(sizes) <= num_tokens - written] if sizes.sum() > num_tokens - written else sizes
        if len(sizes) == 0:
            sizes = np.array([num_tokens - written])
        writer.add_documents(rng.integers(0, vocab_size, size=int(sizes.sum()), dtype=np.int64), sizes)
        written += int(sizes.sum())
        num_docs += len(sizes)
    writer.finalize()
    return num_docs


def time_index_build(work: Path, num_tokens: int, seq_lengths: list[int]) -> list[dict]:
    """Build (from scratch) and then load (from the cache) the indices of one split over every document."""
    from meshtron.data.gpt_dataset import GPTDataset
    from meshtron.data.indexed import IndexedDataset

    prefix = work / "synthetic"
    num_docs = write_synthetic(prefix, num_tokens, vocab_size=32_000)
    indexed = IndexedDataset(prefix)
    rows = []
    for seq_length in seq_lengths:
        def build(seq_length: int = seq_length) -> GPTDataset:
            return GPTDataset(indexed, (0, num_docs), seq_length=seq_length, seed=1234, eod_id=0,
                              cache_dir=str(work / "cache"))
        start = time.perf_counter()
        ds = build()
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        again = build()
        load_s = time.perf_counter() - start
        assert not ds.cache.loaded_from_cache and again.cache.loaded_from_cache and len(again) == len(ds)
        rows.append({"num_tokens": num_tokens, "num_docs": num_docs, "seq_length": seq_length, "num_samples": len(ds),
                     "build_seconds": build_s, "cache_load_seconds": load_s})
    return rows


def prepare(work: Path, tokenizer: str | None, vocab_size: int, max_documents: int | None = None) -> tuple[Path, Path]:
    from meshtron.data.corpus import write_stdlib_jsonl
    from meshtron.data.tokenizer_train import train_bpe

    corpus = work / "stdlib.jsonl"
    write_stdlib_jsonl(corpus, max_documents=max_documents)
    if tokenizer:
        return corpus, Path(tokenizer)
    return corpus, train_bpe([str(corpus)], vocab_size, work / "tokenizer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="preprocess_throughput", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="workers / Rust threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each side; the best is kept (default 3)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory (default: train a BPE on the corpus)")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocab of the trained BPE (default 8192)")
    p.add_argument("--max-documents", type=int, default=None,
                   help="use only the first N stdlib source files (default: all; a small N makes a smoke run)")
    p.add_argument("--index-tokens", type=int, default=100_000_000, help="synthetic tokens for the index build")
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 128],
                   help="sequence lengths of the index builds (default 2048 128)")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help=f"JSON results file (default {DEFAULT_OUTPUT})")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--baseline-child":
        print(json.dumps(baseline_encode(*argv[1:4])))
        return 0
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshtron-bench-") as tmp:
        work = Path(tmp)
        corpus, tok_dir = prepare(work, args.tokenizer, args.vocab_size, args.max_documents)
        corpus_bytes = corpus.stat().st_size
        runs: dict[str, list[dict]] = {"encode_batch": [], "encode_batch_fast": [], "meshtron": []}
        for k in range(args.repeats):
            runs["encode_batch"].append(run_baseline(corpus, tok_dir, args.workers, "encode_batch"))
            runs["encode_batch_fast"].append(run_baseline(corpus, tok_dir, args.workers, "encode_batch_fast"))
            runs["meshtron"].append(run_meshtron(corpus, tok_dir, args.workers, work, k))
        index = time_index_build(work, args.index_tokens, args.seq_lengths)
    best = {name: min(r, key=lambda x: x["seconds"]) for name, r in runs.items()}
    rate = {name: b["num_tokens"] / b["seconds"] for name, b in best.items()}
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "workers": args.workers, "repeats": args.repeats, "max_documents": args.max_documents,
        "corpus_bytes": corpus_bytes,
        "tokens_per_s": rate, "ratio_vs_encode_batch": rate["meshtron"] / rate["encode_batch"],
        "ratio_vs_encode_batch_fast": rate["meshtron"] / rate["encode_batch_fast"],
        "runs": runs, "index_build": index,
    }
    print_table(result)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def print_table(r: dict) -> None:
    rate, n = r["tokens_per_s"], r["runs"]["meshtron"][0]["num_tokens"]
    print(f"preprocess throughput: stdlib corpus, {n:,} tokens, {r['workers']} workers, best of {r['repeats']}")
    print(f"{'side':<40} {'tokens/s':>12} {'vs encode_batch':>16} {'vs encode_batch_fast':>21}")
    labels = {"encode_batch": "tokenizers encode_batch (in memory)",
              "encode_batch_fast": "tokenizers encode_batch_fast (in memory)",
              "meshtron": "meshtron preprocess (jsonl -> bin/idx)"}
    for name, label in labels.items():
        print(f"{label:<40} {rate[name]:>12,.0f} {rate[name] / rate['encode_batch']:>15.2f}x "
              f"{rate[name] / rate['encode_batch_fast']:>20.2f}x")
    for ix in r["index_build"]:
        print(f"GPTDataset indices: {ix['num_tokens']:,} tokens, {ix['num_docs']:,} documents, seq_length "
              f"{ix['seq_length']}, {ix['num_samples']:,} samples: build {ix['build_seconds']:.3f} s, "
              f"cached load {ix['cache_load_seconds']:.3f} s")


if __name__ == "__main__":
    sys.exit(main())
