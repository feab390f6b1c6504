"""Builds megatron-core's own datasets on CPU, as the independent reference of the Megatron-format tests.

megatron-core is imported only here. Its GPTDataset is built the way Megatron-LM builds it
(`BlendedMegatronDatasetBuilder` + `GPTDatasetConfig`) with `torch.distributed` not initialised, so
every rank check falls through to "build here", and a tokenizer stub that carries only the ids
the dataset reads (vocab_size, eod, pad).
"""

from __future__ import annotations

import numpy as np
import pytest

megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")


class StubTokenizer:
    """What GPTDataset asks of a tokenizer: the vocabulary size and the eod and pad ids."""

    def __init__(self, vocab_size: int, eod: int, pad: int):
        self.vocab_size, self.eod, self.pad = vocab_size, eod, pad
        self.unique_identifiers = {"class": "StubTokenizer", "vocab_size": vocab_size, "eod": eod, "pad": pad}

    @property
    def special_tokens_dict(self) -> dict:
        return {"eos_token": self.eod, "pad_token": self.pad}


def write_with_megatron(prefix, docs: list[list[int]], dtype, *, sentences_per_doc: int = 1) -> None:
    """PREFIX.bin/.idx written by megatron-core's IndexedDatasetBuilder, as tools/preprocess_data.py does
    (one add_document per document; with sentences_per_doc > 1, consecutive sequences grouped as one
    document, as `--split-sentences` writes)."""
    import torch

    builder = megatron_indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for k in range(0, len(docs), sentences_per_doc):
        group = docs[k:k + sentences_per_doc]
        flat = np.concatenate([np.asarray(d, dtype=np.int64) for d in group]) if group else np.zeros(0, np.int64)
        builder.add_document(torch.from_numpy(flat), [len(d) for d in group])
    builder.finalize(f"{prefix}.idx")


def read_with_megatron(prefix) -> list[np.ndarray]:
    """Every sequence, copied: megatron-core closes its memory map when the dataset object dies, and a
    view into it would then point at unmapped memory."""
    ds = megatron_indexed.IndexedDataset(str(prefix))
    return [np.array(ds[k], copy=True) for k in range(len(ds))]


def megatron_gpt_datasets(prefix, *, seed: int, seq_length: int, split: str, sizes: list[int | None],
                          cache_dir, eod: int, pad: int, vocab_size: int, add_extra_token: bool = True):
    """[train, valid, test] megatron-core GPTDatasets (None for an empty split) over one prefix."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([str(prefix)], None), split=split,
        path_to_cache=str(cache_dir), tokenizer=StubTokenizer(vocab_size, eod, pad),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, add_extra_token_to_sequence=add_extra_token,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def megatron_sample_text(dataset, i: int) -> np.ndarray:
    """The raw token ids of sample i (seq_length + 1 with the extra token), before masking/padding."""
    text, _, _ = dataset._query_document_sample_shuffle_indices(i)
    return np.asarray(text, dtype=np.int64)
