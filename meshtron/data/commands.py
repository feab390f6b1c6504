"""Data verbs of the `meshtron` command line: tokenizer train, corpus stdlib, preprocess, data merge/info.

`register(subparsers)` adds them to the main CLI; `python -m meshtron.data.commands ...` runs them
alone. Handlers return an exit code; a user error prints one line to stderr and returns 2.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from meshtron.config.schema import TokenizerConfig
from meshtron.data.indexed import DEFAULT_FORMAT, FORMATS


def _user_errors(handler):
    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ValueError as e:   # ConfigError and IndexedDatasetError are ValueErrors
            print(f"error: {e}", file=sys.stderr)
            return 2
    return run


def _tokenizer_config(args: argparse.Namespace) -> TokenizerConfig:
    from meshtron.data.tokenizer import tokenizer_config_for

    if args.config:
        from meshtron.config.loader import load_config

        cfg = load_config(args.config).tokenizer
    elif args.tokenizer:
        cfg = tokenizer_config_for(args.tokenizer, args.tokenizer_type)
    else:
        raise ValueError("--tokenizer: give a tokenizer (byte, a tokenizer.json directory, a .model or .tiktoken "
                         "file) or --config with a tokenizer section")
    for flag in ("eod_token", "pad_token"):
        if getattr(args, flag):
            setattr(cfg, flag, getattr(args, flag))
    if args.allow_ambiguous_pad_tokens:
        cfg.allow_ambiguous_pad_tokens = True
    cfg.validate()
    return cfg


@_user_errors
def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from meshtron.data.tokenizer_train import train_bpe

    out = train_bpe(args.input, args.vocab_size, args.output, json_key=args.json_key, text_unit=args.text_unit,
                    min_frequency=args.min_frequency, max_documents=args.max_documents)
    print(f"wrote {out}/tokenizer.json (byte-level BPE, vocab {args.vocab_size})")
    return 0


@_user_errors
def cmd_corpus_stdlib(args: argparse.Namespace) -> int:
    from meshtron.data.corpus import write_stdlib_jsonl

    if args.max_documents is not None and args.max_documents < 1:
        raise ValueError(f"--max-documents: {args.max_documents} is not allowed; must be >= 1")
    count = write_stdlib_jsonl(args.output, max_documents=args.max_documents)
    print(f"wrote {args.output}: {count} documents")
    return 0


@_user_errors
def cmd_preprocess(args: argparse.Namespace) -> int:
    from meshtron.data.preprocess import PreprocessOptions, preprocess

    opts = PreprocessOptions(
        inputs=args.input, output_prefix=args.output_prefix, tokenizer=_tokenizer_config(args),
        json_key=args.json_key, text_unit=args.text_unit, append_eod=args.append_eod, num_workers=args.workers,
        shard_bytes=int(args.shard_size_mb * (1 << 20)) if args.shard_size_mb else None,
        keep_shards=args.keep_shards, progress=not args.no_progress, format=args.format,
    )
    from meshtron.data.convert import describe

    print(f"wrote {describe(preprocess(opts))}")
    return 0


@_user_errors
def cmd_data_merge(args: argparse.Namespace) -> int:
    from meshtron.data.convert import describe
    from meshtron.data.indexed import merge_datasets

    ds = merge_datasets(args.input, args.output_prefix, verify=not args.no_verify, format=args.format)
    print(f"wrote {describe(ds)}")
    return 0


@_user_errors
def cmd_data_convert(args: argparse.Namespace) -> int:
    from meshtron.data.convert import convert_dataset, describe

    vocab_size = _info_vocab_size(args)
    ds = convert_dataset(args.input, args.output, args.format, vocab_size=vocab_size)
    print(f"wrote {describe(ds)}")
    return 0


def _info_vocab_size(args: argparse.Namespace) -> int | None:
    """The vocabulary `data info` checks ids against: --vocab-size, or the size of --tokenizer."""
    if args.vocab_size is not None and args.tokenizer:
        raise ValueError("--vocab-size: give either --vocab-size or --tokenizer, not both")
    if args.vocab_size is not None:
        if args.vocab_size < 1:
            raise ValueError(f"--vocab-size: {args.vocab_size} is not allowed; must be >= 1")
        return args.vocab_size
    if args.tokenizer:
        from meshtron.data.tokenizer import build_tokenizer, tokenizer_config_for

        return build_tokenizer(tokenizer_config_for(args.tokenizer, args.tokenizer_type)).vocab_size
    return None


def dataset_prefix(path: str) -> str:
    """A dataset named by its prefix or by one of its two files: X, X.bin and X.idx all mean X (a
    prefix that itself ends in .bin, with X.bin.bin beside it, stays as given)."""
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix) and not Path(path + ".bin").exists() and Path(path[:-4] + ".bin").exists():
            return path[:-4]
    return path


@_user_errors
def cmd_data_info(args: argparse.Namespace) -> int:
    from meshtron.data.indexed import IndexedDataset, IndexedDatasetError

    vocab_size = _info_vocab_size(args)
    for prefix in map(dataset_prefix, args.prefix):
        ds = IndexedDataset(prefix)
        max_id = ds.max_token_id
        # Without a recorded maximum, a question about the vocabulary needs the scan --verify does.
        scanned = args.verify or (vocab_size is not None and max_id is None)
        if scanned:
            max_id = ds.verify(vocab_size)
        elif vocab_size is not None and max_id is not None and max_id >= vocab_size:
            raise IndexedDatasetError(f"{prefix}: maximum token id {max_id} >= vocab size {vocab_size}; preprocess "
                                      f"with the model's tokenizer, or give the model a vocabulary of at least {max_id + 1}")
        sizes = ds.sizes
        longest = int(sizes.max()) if len(sizes) else 0
        max_text = max_id if max_id is not None else "none (no tokens)" if ds.num_tokens == 0 else "not recorded"
        checksum = "" if not scanned else ", checksum ok" if ds.crc is not None else ", no checksum recorded"
        checks = checksum + (f", all ids < {vocab_size}" if vocab_size is not None else "")
        vocab = ds.vocab_size if ds.vocab_size is not None else "not recorded"
        fmt = ds.format if ds.format == "meshtron" else "megatron, " + ("with sidecar" if ds.has_sidecar else "no sidecar")
        groups = f" in {len(ds.document_indices) - 1} Megatron documents" if ds.grouped else ""
        print(f"{prefix}: {ds.num_docs} documents{groups}, {ds.num_tokens} tokens, format {fmt}, dtype {ds.dtype}, "
              f"vocab_size {vocab}, longest document {longest}, max token id {max_text}" + checks)
    return 0


def _add_input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="jsonl files (.jsonl/.json/.ndjson), text files, or directories of them")
    p.add_argument("--json-key", default="text", help="jsonl field holding the document text (default: text)")
    p.add_argument("--text-unit", choices=("file", "line"), default="file",
                   help="for text files: one document per file (default) or per line")


def register(subparsers) -> None:
    """Add the data verbs to an argparse subparsers object."""
    tok = subparsers.add_parser("tokenizer", help="train tokenizers")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    train = tok_sub.add_parser("train", help="train a byte-level BPE tokenizer (saved as a HF tokenizer directory)")
    _add_input_args(train)
    train.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size incl. special tokens (default 8192)")
    train.add_argument("--output", required=True, metavar="DIR", help="directory for tokenizer.json and its config")
    train.add_argument("--min-frequency", type=int, default=2, help="merge pairs seen at least this often (default 2)")
    train.add_argument("--max-documents", type=int, default=None, help="train on the first N documents only")
    train.set_defaults(func=cmd_tokenizer_train)

    corpus = subparsers.add_parser("corpus", help="export the embedded corpus")
    corpus_sub = corpus.add_subparsers(dest="corpus_command", required=True)
    stdlib = corpus_sub.add_parser("stdlib", help="write the CPython stdlib sources as jsonl (text, path, license)")
    stdlib.add_argument("--output", required=True, metavar="FILE", help="jsonl file to write")
    stdlib.add_argument("--max-documents", type=int, default=None, metavar="N",
                        help="write only the first N files (sorted by path); default all")
    stdlib.set_defaults(func=cmd_corpus_stdlib)

    pre = subparsers.add_parser("preprocess", help="tokenize jsonl/text into an indexed PREFIX.bin/.idx dataset")
    _add_input_args(pre)
    pre.add_argument("--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    pre.add_argument("--tokenizer", metavar="SPEC", help="byte, a tokenizer.json directory, a .model or .tiktoken file")
    pre.add_argument("--tokenizer-type", choices=("byte", "hf", "sentencepiece", "tiktoken"),
                     help="tokenizer kind when it cannot be told from --tokenizer")
    pre.add_argument("--config", help="take the tokenizer section of this run config instead of --tokenizer")
    pre.add_argument("--eod-token", help="end-of-document token (default: the tokenizer's eos)")
    pre.add_argument("--pad-token", help="padding token (default: the tokenizer's pad)")
    pre.add_argument("--allow-ambiguous-pad-tokens", action="store_true", help="accept a pad id equal to eod or bos")
    pre.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    pre.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    pre.add_argument("--shard-size-mb", type=float, default=None, help="input bytes per shard (default: sized to the input)")
    pre.add_argument("--keep-shards", action="store_true", help="keep PREFIX.shards/ after merging")
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    pre.add_argument("--format", choices=FORMATS, default=DEFAULT_FORMAT,
                     help=f"on-disk format: megatron (Megatron-LM's MMIDIDX .bin/.idx plus a PREFIX.meshtron.json "
                          f"sidecar) or meshtron (default: {DEFAULT_FORMAT})")
    pre.set_defaults(func=cmd_preprocess)

    data = subparsers.add_parser("data", help="indexed dataset tools")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    merge = data_sub.add_parser("merge", help="concatenate indexed datasets in order")
    merge.add_argument("--input", nargs="+", required=True, metavar="PREFIX", help="prefixes to join, in order")
    merge.add_argument("--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    merge.add_argument("--no-verify", action="store_true", help="skip the checksum check of the inputs")
    merge.add_argument("--format", choices=FORMATS, default=None,
                       help="format of the output (default: the first input's)")
    merge.set_defaults(func=cmd_data_merge)
    conv = data_sub.add_parser("convert", help="rewrite a dataset in Megatron's or meshtron's format (streaming)")
    conv.add_argument("--input", required=True, metavar="PREFIX", help="the dataset to read (either format)")
    conv.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    conv.add_argument("--format", choices=FORMATS, required=True, help="format to write: megatron or meshtron")
    conv.add_argument("--vocab-size", type=int, default=None, metavar="N",
                      help="vocabulary size to record, for a Megatron input without a sidecar")
    conv.add_argument("--tokenizer", metavar="SPEC", help="like --vocab-size, with this tokenizer's vocabulary size")
    conv.add_argument("--tokenizer-type", choices=("byte", "hf", "sentencepiece", "tiktoken"),
                      help="tokenizer kind when it cannot be told from --tokenizer")
    conv.set_defaults(func=cmd_data_convert)
    info = data_sub.add_parser("info", help="print the size of indexed datasets (and check them)")
    info.add_argument("prefix", nargs="+", help="dataset prefixes (PREFIX, PREFIX.bin or PREFIX.idx)")
    info.add_argument("--verify", action="store_true",
                      help="scan every token: checksum, maximum id, ids outside the vocabulary")
    info.add_argument("--vocab-size", type=int, default=None, metavar="N",
                      help="refuse ids >= N (checked on the recorded maximum; scanned when none is recorded)")
    info.add_argument("--tokenizer", metavar="SPEC", help="like --vocab-size, with this tokenizer's vocabulary size")
    info.add_argument("--tokenizer-type", choices=("byte", "hf", "sentencepiece", "tiktoken"),
                      help="tokenizer kind when it cannot be told from --tokenizer")
    info.set_defaults(func=cmd_data_info)


def main(argv: list[str] | None = None) -> int:
    from meshtron.config.loader import OneLineParser

    parser = OneLineParser(prog="meshtron", description="meshtron data commands")
    register(parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
