"""File-backed tokenizers: a Hugging Face `tokenizer.json` directory, a SentencePiece model, and a
tiktoken BPE ranks file, all read from local paths (nothing is fetched from a hub).

Each exposes the `Tokenizer` interface of `tokenizer.py`; text is encoded without added bos/eos
(documents get their eod from preprocessing), and special-token strings inside text map to their ids.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from meshtron.config.fields import ConfigError
from meshtron.config.schema import TokenizerConfig
from meshtron.data.tokenizer import resolve_special_ids

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

# Pre-split regexes of two widely used byte-level BPE vocabularies (selectable by name).
TIKTOKEN_PATTERNS = {
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    "cl100k": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}


def _token_name(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _require(path: str | None, what: str) -> Path:
    p = Path(path or "")
    if not path or not p.exists():
        raise ConfigError(f"tokenizer.path: {path!r} not found; give {what}")
    return p


class HFTokenizer:
    """A `tokenizers` tokenizer from tokenizer.json; eos/pad/bos names come from tokenizer_config.json."""

    def __init__(self, cfg: TokenizerConfig):
        from tokenizers import Tokenizer as RustTokenizer

        root = _require(cfg.path, "a directory holding tokenizer.json (or the file itself)")
        file = root / "tokenizer.json" if root.is_dir() else root
        if not file.is_file():
            raise ConfigError(f"tokenizer.path: {str(root)!r} has no tokenizer.json; "
                              "train one with `meshtron tokenizer train` or point at a HF tokenizer directory")
        self._tok = RustTokenizer.from_file(str(file))
        self._tok.no_padding()
        self._tok.no_truncation()
        names: dict = {}
        side = file.parent / "tokenizer_config.json"
        if side.is_file():
            names = json.loads(side.read_text(encoding="utf-8"))
        self._num_base = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        resolve_special_ids(self, cfg, eos=_token_name(names.get("eos_token")), pad=_token_name(names.get("pad_token")),
                            bos=_token_name(names.get("bos_token")), num_base=self._num_base)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking, which preprocessing never reads.
        fast = getattr(self._tok, "encode_batch_fast", None)
        encodings = (fast or self._tok.encode_batch)(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int]) -> str:
        # An added pad id (past the file's vocabulary) has no text.
        return self._tok.decode([i for i in ids if i < self._num_base], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class SentencePieceTokenizer:
    """A SentencePiece model; its own eos/pad/bos pieces unless the config names others."""

    def __init__(self, cfg: TokenizerConfig):
        import sentencepiece

        path = _require(cfg.path, "a SentencePiece .model file")
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))

        def piece(i: int) -> str | None:
            return self._sp.id_to_piece(i) if i >= 0 else None

        resolve_special_ids(self, cfg, eos=piece(self._sp.eos_id()), pad=piece(self._sp.pad_id()),
                            bos=piece(self._sp.bos_id()), num_base=self._sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([i for i in ids if i < self._sp.get_piece_size()])

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        # Unknown pieces map to unk; only the unk piece itself may answer with the unk id.
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: one `base64(token) rank` pair per line."""
    ranks = {}
    for num, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise ConfigError(f"tokenizer.path: {path} line {num} is not 'base64-token rank'; "
                              "give a tiktoken BPE file") from None
    return ranks


def assign_special_ids(entries: list[str], first_free: int, used: set[int]) -> dict[str, int]:
    """'TOKEN=ID' keeps ID; plain 'TOKEN' takes the next id at or after first_free not yet used."""
    out: dict[str, int] = {}
    used = set(used)
    for entry in entries:
        if "=" in entry and entry.rpartition("=")[2].isdigit():
            token, _, pinned = entry.rpartition("=")
            out[token] = int(pinned)
            used.add(int(pinned))
    next_id = first_free
    for entry in entries:
        if "=" in entry and entry.rpartition("=")[2].isdigit():
            continue
        while next_id in used:
            next_id += 1
        out[entry] = next_id
        used.add(next_id)
    return out


class TiktokenTokenizer:
    """tiktoken over a local ranks file, with the configured pre-split pattern and special tokens."""

    def __init__(self, cfg: TokenizerConfig):
        import tiktoken

        path = _require(cfg.path, "a tiktoken BPE ranks file")
        ranks = load_tiktoken_ranks(path)
        pattern = TIKTOKEN_PATTERNS.get(cfg.tiktoken_pattern, cfg.tiktoken_pattern)
        specials = assign_special_ids(cfg.tiktoken_special_tokens, max(ranks.values()) + 1, set(ranks.values()))
        self._enc = tiktoken.Encoding(path.stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        self._ranks, self._specials = ranks, specials
        resolve_special_ids(self, cfg, eos=None, pad=None, bos=None, num_base=self._enc.n_vocab)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all", disallowed_special=())

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([i for i in ids if i < self._enc.n_vocab])

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        return self._ranks.get(token.encode("utf-8"))


BUILDERS = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer, "tiktoken": TiktokenTokenizer}
