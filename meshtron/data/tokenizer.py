"""Tokenizers behind one small interface, and the registry that builds one from `TokenizerConfig`.

The byte tokenizer maps UTF-8 bytes to ids 0-255 and adds special tokens after them; it needs no
files, so it always works. File-backed tokenizers (HF tokenizer.json, SentencePiece, tiktoken) live
in `tokenizer_files.py`. Every tokenizer resolves eod/pad/bos ids once here, where an ambiguous pad
id (equal to eod or bos) is caught: padding that looks like a real token would reach the loss.
"""

from __future__ import annotations

import warnings
from typing import Protocol

from meshtron.config.fields import ConfigError
from meshtron.config.schema import TokenizerConfig


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int
    pad_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


class ByteTokenizer:
    """ids 0-255 are bytes; then <|endoftext|> (eod), <|pad|>, <|bos|> and the FIM sentinels."""

    SPECIALS = ("<|endoftext|>", "<|pad|>", "<|bos|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")

    def __init__(self) -> None:
        self.special_ids = {token: 256 + k for k, token in enumerate(self.SPECIALS)}
        self.eod_id, self.pad_id, self.bos_id = 256, 257, 258
        self.vocab_size = 256 + len(self.SPECIALS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def token_to_id(self, token: str) -> int | None:
        return self.special_ids.get(token)

    def decode(self, ids: list[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
            elif i == self.eod_id:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append("\n")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


def resolve_special_ids(tok, cfg: TokenizerConfig, *, eos: str | None, pad: str | None, bos: str | None,
                        num_base: int) -> None:
    """Set tok.eod_id / pad_id / bos_id / vocab_size from the config, then the tokenizer's own names.

    `eos`/`pad`/`bos` are the token strings the tokenizer files declare (or None). Without any pad
    token one fresh id (= `num_base`) is added, so that padding never collides with a text token.
    """
    def lookup(field: str, name: str | None) -> int | None:
        if name is None:
            return None
        token_id = tok.token_to_id(name)
        if token_id is None:
            raise ConfigError(f"tokenizer.{field}: {name!r} is not in the vocabulary of {cfg.path}; "
                              "name a token the tokenizer has")
        return token_id

    eod_name = cfg.eod_token or eos or ("<|endoftext|>" if tok.token_to_id("<|endoftext|>") is not None else None)
    if eod_name is None:
        raise ConfigError(f"tokenizer.eod_token: {cfg.path} declares no end-of-document token; "
                          "set tokenizer.eod_token to one of its special tokens")
    tok.eod_id = lookup("eod_token", eod_name)
    tok.bos_id = lookup("bos_token", cfg.bos_token or bos)
    pad_name = cfg.pad_token or pad or ("<|pad|>" if tok.token_to_id("<|pad|>") is not None else None)
    tok.vocab_size = num_base
    if pad_name is None:
        tok.pad_id, tok.vocab_size = num_base, num_base + 1
    else:
        tok.pad_id = lookup("pad_token", pad_name)
    check_pad_ambiguity(tok, cfg.allow_ambiguous_pad_tokens)


def check_pad_ambiguity(tok, allow: bool) -> None:
    """Warn when pad equals eod or bos; refuse unless the user allowed it explicitly."""
    clashes = [name for name, i in (("eod", tok.eod_id), ("bos", tok.bos_id)) if i is not None and i == tok.pad_id]
    if not clashes:
        return
    message = (f"tokenizer.pad_token: the pad id {tok.pad_id} equals the {' and '.join(clashes)} id, so padding "
               "cannot be told apart from real tokens; set tokenizer.pad_token to a distinct token")
    warnings.warn(message, stacklevel=3)
    if not allow:
        raise ConfigError(message + " (or set tokenizer.allow_ambiguous_pad_tokens: true)")


def _build_byte(cfg: TokenizerConfig) -> Tokenizer:
    tok = ByteTokenizer()
    if cfg.eod_token or cfg.pad_token or cfg.bos_token:
        resolve_special_ids(tok, cfg, eos=None, pad=None, bos=None, num_base=tok.vocab_size)
    return tok


def _build_from_files(cfg: TokenizerConfig) -> Tokenizer:
    from meshtron.data import tokenizer_files  # heavy optional imports stay out of the byte path

    return tokenizer_files.BUILDERS[cfg.type](cfg)


TOKENIZERS = {"byte": _build_byte, "hf": _build_from_files, "sentencepiece": _build_from_files,
              "tiktoken": _build_from_files}


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    if cfg.type not in TOKENIZERS:
        raise ConfigError(f"tokenizer.type: {cfg.type!r} is not allowed; choose one of: {', '.join(TOKENIZERS)}")
    cfg.validate()
    return TOKENIZERS[cfg.type](cfg)


def tokenizer_config_for(spec: str, type_: str | None = None) -> TokenizerConfig:
    """A TokenizerConfig from a command-line `--tokenizer` value: 'byte', a directory, .model or .tiktoken file."""
    if type_ is None:
        if spec == "byte":
            type_ = "byte"
        elif spec.endswith(".model"):
            type_ = "sentencepiece"
        elif spec.endswith((".tiktoken", ".bpe")):
            type_ = "tiktoken"
        else:
            type_ = "hf"
    return TokenizerConfig(type=type_, path=None if type_ == "byte" else spec)
