"""Supervised fine-tuning data: chat jsonl -> token ids with a loss mask on the assistant's tokens,
packed best-fit into samples whose conversations never see each other.

A line is {"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}. The
conversation is rendered with the chat template (data/chat.py) one message at a time: message k
covers the text that render(messages[:k+1]) adds to render(messages[:k]), and for an assistant
message the part that render(messages[:k], add_generation_prompt=True) adds (the "assistant turn"
header) is prompt, not reply. Each piece is tokenized on its own and the pieces are concatenated,
so a token is either wholly assistant text or wholly not. The loss mask covers the assistant's
content and the template's end-of-turn text after it (so the model learns to stop).

A template that does not render conversations incrementally (a later render that does not start
with an earlier one) is refused with a message naming data.chat_template.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from meshtron.config.fields import ConfigError
from meshtron.config.schema import RunConfig
from meshtron.data.chat import read_chat_template, render_messages
from meshtron.data.documents import lone_surrogate
from meshtron.data.packing import assemble_sample, best_fit_decreasing
from meshtron.data.stream import split_documents
from meshtron.data.tokenizer import Tokenizer


@dataclass
class Conversation:
    token_ids: np.ndarray       # (n,) int64
    assistant_mask: np.ndarray  # (n,) bool: True where the token is assistant reply text


def read_conversations(paths: list[str]) -> list[list[dict[str, Any]]]:
    """Every `messages` list of the jsonl files, in order; a malformed line names file and line."""
    out = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"data.paths: {path!r} is not a file; data.format sft reads chat jsonl files")
        for num, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data.paths: {path} line {num} is not valid JSON ({e.msg})") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise ConfigError(f"data.paths: {path} line {num} has no 'messages' list of {{'role', 'content'}} "
                                  "objects; data.format sft reads chat jsonl")
            for k, message in enumerate(messages):
                if (problem := _content_problem(message.get("content"))) is not None:
                    raise ConfigError(f"data.paths: {path} line {num}: message {k} content {problem}; "
                                      "fix or drop that line")
            out.append(messages)
    return out


def _content_problem(content: Any) -> Optional[str]:
    """What is wrong with a message's content; None for a string, null, or a list of parts whose
    texts are strings (what chat.message_text reads)."""
    if content is None:
        return None
    if isinstance(content, str):
        texts = [content]
    elif isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
        texts = [p.get("text", "") for p in content]
    else:
        return "is not a string, null or a list of {'type', 'text'} parts"
    for text in texts:
        if (bad := lone_surrogate(text)) is not None:
            return f"holds {bad}, which is not text"
    return None


def tokenize_conversation(messages: list[dict[str, Any]], render: Callable[[list, bool], str],
                          encode: Callable[[str], list[int]]) -> Conversation:
    """Token ids and the assistant mask of one conversation (see the module docstring)."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = render(messages[:k], True)
            _check_prefix(done, prompt)
            pieces.append((prompt[len(done):], False))
            done = prompt
        text = render(messages[:k + 1], False)
        _check_prefix(done, text)
        pieces.append((text[len(done):], message["role"] == "assistant"))
        done = text
    ids: list[int] = []
    mask: list[bool] = []
    for text, is_assistant in pieces:
        if text:
            piece = encode(text)
            ids += piece
            mask += [is_assistant] * len(piece)
    return Conversation(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool))


def _check_prefix(before: str, after: str) -> None:
    if not after.startswith(before):
        raise ConfigError("data.chat_template: the template does not render a conversation incrementally (adding a "
                          "message changes earlier text), so assistant tokens cannot be found; use a template "
                          "that only appends, e.g. ChatML")


class SFTDataset:
    """Samples of seq_length positions: conversations packed best-fit (pack=True) or one per sample.

    Conversation j of n tokens gives n - 1 input/label positions, its label at position i masked to
    whether token i + 1 is assistant text. Longer conversations are cut to seq_length + 1 tokens.
    """

    def __init__(self, conversations: list[Conversation], seq_length: int, pad_id: int, pack: bool = True):
        self.seq_length, self.pad_id = seq_length, pad_id
        self.conversations = []
        self.num_truncated = 0
        for c in conversations:
            if len(c.token_ids) > seq_length + 1:
                self.num_truncated += 1
                c = Conversation(c.token_ids[:seq_length + 1], c.assistant_mask[:seq_length + 1])
            if len(c.token_ids) >= 2 and c.assistant_mask[1:].any():
                self.conversations.append(c)
        lengths = np.array([len(c.token_ids) - 1 for c in self.conversations], dtype=np.int64)
        if pack:
            self.samples = [sorted(b) for b in best_fit_decreasing(lengths, seq_length)]
        else:
            self.samples = [[j] for j in range(len(self.conversations))]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        pieces = [(c.token_ids, c.assistant_mask[1:].astype(np.float32))
                  for c in (self.conversations[j] for j in self.samples[i])]
        return assemble_sample(pieces, self.seq_length, self.pad_id)


def chat_template_for(cfg: RunConfig) -> Optional[str]:
    """data.chat_template's file, else the hf tokenizer directory's template, else None (ChatML)."""
    if cfg.data.chat_template:
        path = Path(cfg.data.chat_template)
        if not path.is_file():
            raise ConfigError(f"data.chat_template: {str(path)!r} is not a file; give a Jinja template file or null")
        return path.read_text(encoding="utf-8")
    return read_chat_template(cfg.tokenizer.path) if cfg.tokenizer.type == "hf" else None


def build_sft_datasets(cfg: RunConfig, tokenizer: Tokenizer) -> list[SFTDataset]:
    """[train, valid, test]: the conversations split by data.split (seeded), each split packed on its own."""
    template = chat_template_for(cfg)

    def render(messages: list, add_generation_prompt: bool) -> str:
        return render_messages(messages, template, tokenizer, add_generation_prompt)

    conversations = [tokenize_conversation(m, render, tokenizer.encode) for m in read_conversations(cfg.data.paths)]
    out = []
    for part in split_documents(len(conversations), cfg.data.split_weights(), cfg.data.seed):
        out.append(SFTDataset([conversations[j] for j in part], cfg.data.seq_length, tokenizer.pad_id,
                              pack=cfg.data.sft_pack))
    truncated = sum(d.num_truncated for d in out)
    if truncated:
        warnings.warn(f"data.seq_length: {truncated} conversations are longer than {cfg.data.seq_length} + 1 tokens "
                      "and were cut; raise data.seq_length to keep them whole", stacklevel=2)
    if len(out[0]) == 0:
        raise ConfigError(f"data.paths: {', '.join(cfg.data.paths)} hold no training conversation with an assistant "
                          "reply; check the 'messages' roles or data.split")
    return out
