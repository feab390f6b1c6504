"""Supervised fine-tuning data: the loss mask covers exactly the assistant tokens (found independently
by string search in the rendered conversation), and packed and unpacked runs give equal losses."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from meshtron.config import ConfigError, load_config
from meshtron.data.chat import render_messages
from meshtron.data.sft import SFTDataset, build_sft_datasets, tokenize_conversation
from meshtron.data.tokenizer import ByteTokenizer, build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "Six, written 6."},
]

# A Llama-3-like template: bos once, a header per message, an end-of-turn marker after each message.
LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def assistant_char_spans(text: str, messages, end_marker: str) -> list[tuple[int, int]]:
    """Independent reference: each assistant content and the end marker after it, found by search."""
    spans, at = [], 0
    for m in messages:
        start = text.index(m["content"], at)
        end = start + len(m["content"])
        if m["role"] == "assistant":
            assert text.startswith(end_marker, end)
            spans.append((start, end + len(end_marker)))
        at = end
    return spans


def byte_mask(text: str, spans) -> np.ndarray:
    """Byte-level positions of the character spans (the byte tokenizer has one token per byte)."""
    mask = np.zeros(len(text.encode()), dtype=bool)
    for start, end in spans:
        mask[len(text[:start].encode()):len(text[:end].encode())] = True
    return mask


@pytest.mark.parametrize("template,end_marker", [(None, "<|im_end|>\n"), (LLAMA_LIKE, "<|eot_id|>")])
def test_mask_covers_exactly_the_assistant_tokens(template, end_marker):
    tok = ByteTokenizer()
    conv = tokenize_conversation(CONVERSATION, lambda m, g: render_messages(m, template, tok, g), tok.encode)
    full = render_messages(CONVERSATION, template, tok, add_generation_prompt=False)
    assert tok.decode(conv.token_ids.tolist()) == full
    expected = byte_mask(full, assistant_char_spans(full, CONVERSATION, end_marker))
    np.testing.assert_array_equal(conv.assistant_mask, expected)
    assert conv.assistant_mask.sum() == len("4.") + len("Six, written 6.") + 2 * len(end_marker)


def test_mask_with_a_bpe_tokenizer_and_its_own_template(bpe_dir, tmp_path):
    """A HF tokenizer directory with a chat template: the masked tokens decode to the assistant text."""
    tok_dir = tmp_path / "tok"
    shutil.copytree(bpe_dir, tok_dir)
    side = tok_dir / "tokenizer_config.json"
    config = json.loads(side.read_text()) if side.exists() else {}
    side.write_text(json.dumps({**config, "chat_template": LLAMA_LIKE}))
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    cfg = load_config(overrides={"data.format": "sft", "data.paths": str(path), "data.split": "1,0,0",
                                 "tokenizer.type": "hf", "tokenizer.path": str(tok_dir), "data.seq_length": "512",
                                 "model.max_position_embeddings": "512"})
    tok = build_tokenizer(cfg.tokenizer)
    train = build_sft_datasets(cfg, tok)[0]
    sample = train[0]
    n = int((sample["document_ids"] == 0).sum())
    ids = np.concatenate([sample["input_ids"][:1], sample["labels"][:n]])
    mask = np.concatenate([[False], sample["loss_mask"][:n] > 0])
    full = render_messages(CONVERSATION, LLAMA_LIKE, tok, add_generation_prompt=False)
    assert tok.decode(ids.tolist()) == full
    # the masked runs of tokens, decoded, are exactly the assistant contents with their end markers
    runs, current = [], []
    for i, m in zip(ids.tolist(), mask):
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current))
            current = []
    runs += [tok.decode(current)] if current else []
    assert runs == ["4.<|eot_id|>", "Six, written 6.<|eot_id|>"]


def test_a_template_that_rewrites_earlier_text_is_refused():
    tok = ByteTokenizer()
    # numbers every message with the total count, so adding a message changes the earlier text
    bad = "{% for m in messages %}[{{ messages|length }}] {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ConfigError, match="data.chat_template"):
        tokenize_conversation(CONVERSATION, lambda m, g: render_messages(m, bad, tok, g), tok.encode)


def test_packed_samples_keep_conversations_apart():
    tok = ByteTokenizer()
    convs = [tokenize_conversation([{"role": "user", "content": "q" * k}, {"role": "assistant", "content": "a" * k}],
                                   lambda m, g: render_messages(m, None, tok, g), tok.encode) for k in (3, 20, 7, 40)]
    packed = SFTDataset(convs, seq_length=256, pad_id=tok.pad_id, pack=True)
    unpacked = SFTDataset(convs, seq_length=256, pad_id=tok.pad_id, pack=False)
    assert len(unpacked) == 4 and len(packed) < 4
    total = sum(float(packed[i]["loss_mask"].sum()) for i in range(len(packed)))
    assert total == sum(float(unpacked[i]["loss_mask"].sum()) for i in range(4)) == sum(
        float(c.assistant_mask[1:].sum()) for c in convs)
    for i in range(len(packed)):
        s = packed[i]
        for d in np.unique(s["document_ids"]):
            where = np.flatnonzero(s["document_ids"] == d)
            np.testing.assert_array_equal(s["position_ids"][where], np.arange(len(where)))


def write_chats(path, count: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "pi", "tau", "x", "yes", "no", "42"]
    with open(path, "w") as f:
        for _ in range(count):
            turns = [{"role": "system", "content": "be terse"}] if rng.random() < 0.5 else []
            for _ in range(int(rng.integers(1, 3))):
                turns.append({"role": "user", "content": " ".join(rng.choice(words, int(rng.integers(1, 4))))})
                turns.append({"role": "assistant", "content": " ".join(rng.choice(words, int(rng.integers(1, 5))))})
            f.write(json.dumps({"messages": turns}) + "\n")


def test_packed_and_unpacked_runs_give_equal_losses(tiny_config, tmp_path):
    """Each step covers every conversation once, so packing changes only how they are laid out."""
    from meshtron.training import Trainer

    path = tmp_path / "chats.jsonl"
    write_chats(path, 14)
    common = {"data.format": "sft", "data.paths": str(path), "data.split": "1,0,0", "data.seq_length": "256",
              "model.max_position_embeddings": "256", "optimizer.type": "sgd", "optimizer.lr": "0.5",
              "train.train_iters": "3", "train.micro_batch_size": "1", "checkpoint.save_at_end": "false"}
    results = {}
    for pack in ("true", "false"):
        cfg = tiny_config(**common, **{"data.sft_pack": pack, "train.global_batch_size": "1"})
        n = len(build_sft_datasets(cfg, build_tokenizer(cfg.tokenizer))[0])
        cfg = tiny_config(**common, **{"data.sft_pack": pack, "train.global_batch_size": str(n),
                                       "train.run_dir": str(tmp_path / pack)})
        results[pack] = (n, [r.loss for r in Trainer(cfg).train()])
    assert results["true"][0] < results["false"][0] == 14      # packing used fewer samples
    assert results["true"][1] == pytest.approx(results["false"][1], abs=2e-6, rel=0)
    assert results["true"][1][-1] < results["true"][1][0]     # and it trained


@pytest.mark.parametrize("content,message", [
    (123, "message 1 content is not a string, null or a list"),
    ({"text": "x"}, "message 1 content is not a string"),
    ([{"type": "text", "text": None}], "message 1 content is not a string"),
    ("a \ud800 b", "message 1 content holds a lone surrogate U\\+D800 at character 2"),
    ([{"type": "text", "text": "\udfff"}], "message 1 content holds a lone surrogate U\\+DFFF"),
])
def test_chat_content_that_is_not_text_names_file_and_line(tmp_path, content, message):
    """Issue 16: a number, an object or a lone surrogate as content used to reach the template (a
    TypeError traceback, or the text "{'text': 'x'}") or the tokenizer's UTF-8 encoder."""
    from meshtron.data.sft import read_conversations

    path = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": CONVERSATION})
    bad = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]})
    path.write_text(f"{good}\n\n{bad}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"data.paths: {path} line 3: {message}"):
        read_conversations([str(path)])
    for fine in (None, "text", [{"type": "text", "text": "a"}, {"type": "image_url"}]):
        path.write_text(json.dumps({"messages": [{"role": "assistant", "content": fine}]}) + "\n")
        assert read_conversations([str(path)])[0][0]["content"] == fine
