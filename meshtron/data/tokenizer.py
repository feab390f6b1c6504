"""Tokenizers behind one small interface. The byte tokenizer maps UTF-8 bytes to ids 0-255 and
adds special tokens after them; it needs no files, so it always works."""

from __future__ import annotations

from typing import Protocol

from meshtron.config.schema import TokenizerConfig


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int
    pad_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """ids 0-255 are bytes; 256 <|endoftext|> (eod), 257 <|pad|>, 258 <|bos|>."""

    SPECIALS = ("<|endoftext|>", "<|pad|>", "<|bos|>")

    def __init__(self) -> None:
        self.eod_id, self.pad_id, self.bos_id = 256, 257, 258
        self.vocab_size = 256 + len(self.SPECIALS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

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


TOKENIZERS: dict[str, type] = {"byte": ByteTokenizer}


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    return TOKENIZERS[cfg.type]()
