"""Train a byte-level BPE tokenizer with the `tokenizers` library and save it as a Hugging Face
tokenizer directory (tokenizer.json + tokenizer_config.json + special_tokens_map.json), which
`transformers.AutoTokenizer.from_pretrained(DIR)` and `tokenizer.type: hf` both load.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from meshtron.data.documents import iter_documents

EOD_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")
SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN, *FIM_TOKENS)


def train_bpe(inputs: list[str], vocab_size: int, output: str | Path, *, json_key: str = "text",
              text_unit: str = "file", min_frequency: int = 2, max_documents: int | None = None,
              extra_special_tokens: tuple[str, ...] = ()) -> Path:
    """Train on every document of `inputs` (jsonl or text files/directories); returns the output dir.

    Special tokens take ids 0.. in the order <|endoftext|>, <|pad|>, FIM sentinels, extras; the 256
    byte symbols follow, so any UTF-8 text encodes without an unknown token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = list(dict.fromkeys(SPECIAL_TOKENS + tuple(extra_special_tokens)))
    if vocab_size < 256 + len(specials):
        raise ValueError(f"--vocab-size: {vocab_size} is too small; byte-level BPE needs at least "
                         f"{256 + len(specials)} (256 bytes + {len(specials)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def texts() -> Iterator[str]:
        for num, doc in enumerate(iter_documents(inputs, json_key=json_key, text_unit=text_unit)):
            if max_documents is not None and num >= max_documents:
                return
            yield doc

    tok.train_from_iterator(texts(), trainer=trainer)
    return save_hf_tokenizer(tok, output)


def save_hf_tokenizer(tok, output: str | Path) -> Path:
    """Write the files `AutoTokenizer` needs to rebuild a fast tokenizer with our special tokens."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    # No bos token: documents are separated by eod alone (GPT-2 style), and nothing is added on encode.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN, "unk_token": None,
        "additional_special_tokens": list(FIM_TOKENS),
        "clean_up_tokenization_spaces": False, "model_max_length": 1_000_000_000,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": list(FIM_TOKENS)}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out
