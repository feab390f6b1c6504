"""`meshtron preprocess`: tokenize jsonl/text inputs into one PREFIX.bin/.idx pair with a pool of workers.

The inputs are cut into shards (see documents.py); each worker tokenizes whole shards in batches and
writes `PREFIX.shards/NNNNNN.bin/.idx`. A shard whose .idx exists is finished, so an interrupted run
resumes where it stopped; when every shard is done they are concatenated in order into PREFIX and
the shard directory is removed. A manifest refuses to resume with different inputs or options.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshtron.config.schema import TokenizerConfig
from meshtron.data.documents import DEFAULT_SHARD_BYTES, Shard, iter_shard_documents, list_input_files, plan_shards
from meshtron.data.indexed import DEFAULT_FORMAT, IndexedDataset, IndexedDatasetWriter, check_format, merge_datasets
from meshtron.data.tokenizer import build_tokenizer

MAX_BATCH_DOCS = 512
MAX_BATCH_CHARS = 4 << 20   # bounds a worker's memory: one batch of text and its ids at a time
MIN_SHARD_BYTES = 1 << 20
SHARDS_PER_WORKER = 8       # enough shards that workers finish close together


@dataclass
class PreprocessOptions:
    inputs: list[str]
    output_prefix: str
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    json_key: str = "text"
    text_unit: str = "file"
    append_eod: bool = False
    num_workers: int = 1
    shard_bytes: int | None = None   # None: sized from the input so every worker gets several shards
    keep_shards: bool = False
    progress: bool = True
    format: str = DEFAULT_FORMAT     # megatron | meshtron: the on-disk format of PREFIX.bin/.idx


def _manifest(opts: PreprocessOptions, shard_bytes: int) -> dict:
    files = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in list_input_files(opts.inputs)]
    return {"version": 1, "files": files, "json_key": opts.json_key, "text_unit": opts.text_unit,
            "append_eod": opts.append_eod, "tokenizer": dataclasses.asdict(opts.tokenizer), "shard_bytes": shard_bytes}


def _choose_shard_bytes(opts: PreprocessOptions) -> int:
    if opts.shard_bytes is not None:
        return opts.shard_bytes
    total = sum(f.stat().st_size for f in list_input_files(opts.inputs))
    return int(min(DEFAULT_SHARD_BYTES, max(MIN_SHARD_BYTES, total // (opts.num_workers * SHARDS_PER_WORKER))))


def _open_work_dir(opts: PreprocessOptions) -> tuple[Path, int]:
    """The shard directory and shard size, reusing a previous run's when its manifest matches."""
    work_dir = Path(f"{opts.output_prefix}.shards")
    manifest_path = work_dir / "manifest.json"
    if manifest_path.is_file():
        previous = json.loads(manifest_path.read_text())
        if opts.shard_bytes is None or opts.shard_bytes == previous.get("shard_bytes"):
            # Compare through JSON so tuples and lists read the same.
            if json.loads(json.dumps(_manifest(opts, previous["shard_bytes"]))) == previous:
                return work_dir, previous["shard_bytes"]
        raise ValueError(f"--output-prefix: {work_dir} holds an unfinished run with other inputs or options; "
                         "re-run with the same arguments to resume, or delete that directory to start over")
    shard_bytes = _choose_shard_bytes(opts)
    work_dir.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(_manifest(opts, shard_bytes)))
    return work_dir, shard_bytes


_WORKER: dict = {}


def _init_worker(tokenizer_cfg: TokenizerConfig) -> None:
    # One thread per worker: the pool is the parallelism (and forked Rust thread pools misbehave).
    _WORKER["tokenizer"] = build_tokenizer(tokenizer_cfg)


def _flatten(ids: list[list[int]], eod: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-document id lists (each followed by eod when given) into one array + sizes."""
    sizes = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    if eod is not None:
        ids = [x for pair in zip(ids, itertools.repeat([eod])) for x in pair]
        sizes += 1
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(sizes.sum()))
    return flat, sizes


def process_shard(index: int, shard: Shard, out_prefix: str, json_key: str, append_eod: bool,
                  format: str = DEFAULT_FORMAT) -> tuple[int, int, int]:
    """Tokenize one shard into out_prefix.bin/.idx; returns (index, num_docs, num_tokens)."""
    tok = _WORKER["tokenizer"]
    writer = IndexedDatasetWriter(out_prefix, tok.vocab_size, format)
    eod = tok.eod_id if append_eod else None
    num_docs, batch, num_chars = 0, [], 0

    def flush() -> None:
        if batch:
            flat, sizes = _flatten(tok.encode_batch(batch), eod)
            writer.add_documents(flat, sizes)
            batch.clear()

    try:
        for doc in iter_shard_documents(shard, json_key):
            batch.append(doc)
            num_docs, num_chars = num_docs + 1, num_chars + len(doc)
            if len(batch) >= MAX_BATCH_DOCS or num_chars >= MAX_BATCH_CHARS:
                flush()
                num_chars = 0
        flush()
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    return index, num_docs, writer.num_tokens


def _run_one(job: tuple) -> tuple[int, int, int]:
    return process_shard(*job)


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr,
                disable=not enabled, dynamic_ncols=True)


def preprocess(opts: PreprocessOptions, *, max_shards: int | None = None) -> IndexedDataset | None:
    """Run (or resume) preprocessing. With `max_shards`, stop after that many new shards and return
    None without merging (what an interrupted run leaves behind)."""
    if opts.num_workers < 1:
        raise ValueError(f"--workers: {opts.num_workers} is not allowed; must be >= 1")
    check_format(opts.format)
    build_tokenizer(opts.tokenizer)  # fail here, once, with the config error rather than in every worker
    work_dir, shard_bytes = _open_work_dir(opts)
    shards = plan_shards(opts.inputs, text_unit=opts.text_unit, shard_bytes=shard_bytes)
    prefixes = [str(work_dir / f"{k:06d}") for k in range(len(shards))]
    todo = [k for k in range(len(shards)) if not Path(prefixes[k] + ".idx").is_file()]
    stopped_early = max_shards is not None and len(todo) > max_shards
    todo = todo[:max_shards] if max_shards is not None else todo
    jobs = [(k, shards[k], prefixes[k], opts.json_key, opts.append_eod, opts.format) for k in todo]
    with _progress_bar(sum(s.num_bytes for s in shards), opts.progress) as bar:
        pending = set(todo)
        bar.update(sum(shards[k].num_bytes for k in range(len(shards)) if k not in pending))
        for k, _, _ in _map_jobs(jobs, opts):
            bar.update(shards[k].num_bytes)
    if stopped_early:
        return None
    dataset = merge_datasets(prefixes, opts.output_prefix, verify=False, format=opts.format)
    if not opts.keep_shards:
        shutil.rmtree(work_dir)
    return dataset


@contextlib.contextmanager
def _single_threaded_tokenizers():
    """TOKENIZERS_PARALLELISM=false while preprocessing (restored after): one thread per worker."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _map_jobs(jobs: list[tuple], opts: PreprocessOptions):
    """Run jobs in a process pool (results in completion order), or in this process for one worker."""
    with _single_threaded_tokenizers():
        if opts.num_workers == 1 or len(jobs) <= 1:
            _init_worker(opts.tokenizer)
            for job in jobs:
                yield process_shard(*job)
            return
        # fork starts workers in milliseconds; the parent has run no torch op in the CLI, and workers
        # never touch torch, so forking is safe here.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        ctx = multiprocessing.get_context(method)
        num_procs = min(opts.num_workers, len(jobs))
        with ctx.Pool(num_procs, initializer=_init_worker, initargs=(opts.tokenizer,)) as pool:
            yield from pool.imap_unordered(_run_one, jobs)
