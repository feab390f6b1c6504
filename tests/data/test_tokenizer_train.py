"""`tokenizer train`: a byte-level BPE tokenizer that round-trips any text, keeps its special tokens
at fixed ids, and loads in `transformers.AutoTokenizer` with the same ids as meshtron's loader."""

from __future__ import annotations

import json

import pytest
from data_helpers import MULTILINGUAL

from meshtron.data.tokenizer import build_tokenizer, tokenizer_config_for
from meshtron.data.tokenizer_train import SPECIAL_TOKENS, train_bpe


def test_bpe_specials_vocab_and_round_trip(bpe_dir, documents):
    tok = build_tokenizer(tokenizer_config_for(str(bpe_dir)))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.vocab_size == 600
    for text in documents[:5] + MULTILINGUAL + ["\x00 unseen bytes \uffff 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]:
        assert tok.decode(tok.encode(text)) == text
    # Merges were learned: the training text takes fewer tokens than bytes.
    assert len(tok.encode(documents[0])) < 0.6 * len(documents[0].encode("utf-8"))
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and config["pad_token"] == "<|pad|>"


def test_autotokenizer_loads_the_trained_directory(bpe_dir, documents):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    tok = build_tokenizer(tokenizer_config_for(str(bpe_dir)))
    for text in documents[:3] + MULTILINGUAL:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert (hf.eos_token_id, hf.pad_token_id) == (tok.eod_id, tok.pad_id)
    assert hf.convert_tokens_to_ids("<|fim_middle|>") == tok.token_to_id("<|fim_middle|>")


def test_vocab_size_too_small_is_a_user_error(tmp_path, jsonl_file):
    with pytest.raises(ValueError, match="--vocab-size"):
        train_bpe([str(jsonl_file)], 100, tmp_path / "tok")
