"""Token-stream dataset over raw documents: documents are tokenized, each followed by eod,
concatenated, and cut into windows of seq_length + 1 tokens (consecutive windows share one
token, so every token is a label exactly once). Used for the embedded stdlib corpus read raw."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from meshtron.config.schema import DataConfig
from meshtron.data.corpus import iter_stdlib_documents
from meshtron.data.samples import make_sample
from meshtron.data.tokenizer import ByteTokenizer, Tokenizer


class TokenStreamDataset:
    def __init__(self, tokens: np.ndarray, seq_length: int, tokenizer: Tokenizer, *,
                 reset_attention_mask: bool = False, reset_position_ids: bool = False):
        self.tokens, self.seq_length, self.tokenizer = tokens, seq_length, tokenizer
        self.reset_attention_mask, self.reset_position_ids = reset_attention_mask, reset_position_ids

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_length)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_length
        return make_sample(self.tokens[start:start + self.seq_length + 1], self.tokenizer.eod_id,
                           self.tokenizer.pad_id, reset_attention_mask=self.reset_attention_mask,
                           reset_position_ids=self.reset_position_ids)


def encode_document(tokenizer: Tokenizer, text: str) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    return np.asarray(tokenizer.encode(text), dtype=np.int32)


def split_documents(num_docs: int, weights: list[float], seed: int) -> list[np.ndarray]:
    """Seeded permutation of document indices cut into consecutive parts by weight."""
    order = np.random.default_rng(seed).permutation(num_docs)
    bounds = np.round(np.cumsum([0.0] + weights) * num_docs).astype(int)
    bounds[-1] = num_docs
    return [order[bounds[k]:bounds[k + 1]] for k in range(len(weights))]


def build_stream_datasets(cfg: DataConfig, tokenizer: Tokenizer,
                          documents: Iterable[str] | None = None) -> list[TokenStreamDataset]:
    """Train/valid/test token streams from `documents` (default: the stdlib sources), split by document."""
    if documents is None:
        documents = (text for _, text in iter_stdlib_documents())
    docs = [encode_document(tokenizer, t) for t in documents]
    eod = np.array([tokenizer.eod_id], dtype=np.int32)
    out = []
    for part in split_documents(len(docs), cfg.split_weights(), cfg.seed):
        pieces = [x for i in part for x in (docs[i], eod)]
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        out.append(TokenStreamDataset(tokens, cfg.seq_length, tokenizer,
                                      reset_attention_mask=cfg.reset_attention_mask,
                                      reset_position_ids=cfg.reset_position_ids))
    return out
