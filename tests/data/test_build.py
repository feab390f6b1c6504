"""build_datasets from `data.paths`: weighted blends, splits by document, FIM and best-fit packing
switched on from the config, clear errors, and a short training run on a BPE-preprocessed blend."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from data_helpers import random_docs, rewrite_idx, set_token, write_indexed

from meshtron.config import ConfigError
from meshtron.config.schema import DataConfig
from meshtron.data.blended import BlendedDataset
from meshtron.data.build import build_datasets
from meshtron.data.fim import GPTFIMDataset
from meshtron.data.gpt_dataset import GPTDataset
from meshtron.data.indexed import IndexedDataset, IndexedDatasetError
from meshtron.data.packing import PackedDataset
from meshtron.data.preprocess import PreprocessOptions, preprocess
from meshtron.data.tokenizer import ByteTokenizer, build_tokenizer, tokenizer_config_for

BYTE = ByteTokenizer()


def test_paths_parse_into_weights_and_prefixes():
    assert DataConfig(paths=["0.7", "a", "0.3", "b"]).blend() == ([0.7, 0.3], ["a", "b"])
    assert DataConfig(paths=["3", "a", "1", "b"]).blend() == ([0.75, 0.25], ["a", "b"])
    assert DataConfig(paths=["a", "b"]).blend() == ([0.5, 0.5], ["a", "b"])
    assert DataConfig(paths=[]).blend() == ([], [])
    for bad in (["0.7", "a", "0.3"], ["0.7", "a", "b", "c"], ["a", "0.5"], ["-1", "a", "2", "b"]):
        with pytest.raises(ConfigError, match="data.paths"):
            DataConfig(paths=bad).validate()
    for field, value in (("fim_rate", 1.5), ("fim_spm_rate", -0.1)):
        with pytest.raises(ConfigError, match=f"data.{field}"):
            DataConfig(**{field: value}).validate()


@pytest.fixture
def byte_prefixes(tmp_path):
    rng = np.random.default_rng(0)
    out = []
    for k, num_docs in enumerate((60, 25)):
        docs = [d + [BYTE.eod_id] for d in random_docs(rng, num_docs, 80, vocab_size=256, min_len=20)]
        out.append(str(write_indexed(tmp_path / f"p{k}", docs, vocab_size=BYTE.vocab_size).prefix))
    return out


def test_single_prefix_splits_by_document(tiny_config, byte_prefixes):
    cfg = tiny_config(**{"data.paths": f"[{byte_prefixes[0]}]", "data.split": "80,10,10", "train.train_iters": "200"})
    train, valid, test = build_datasets(cfg, BYTE)
    assert all(isinstance(ds, GPTDataset) for ds in (train, valid, test))
    assert (train.doc_range, valid.doc_range, test.doc_range) == ((0, 48), (48, 54), (54, 60))
    assert len(train) >= 200 * 4 and train.num_epochs > 1       # enough samples for every step
    assert valid.num_epochs == 1 and len(valid) > 0


def test_weighted_blend(tiny_config, byte_prefixes):
    paths = f"[0.7, {byte_prefixes[0]}, 0.3, {byte_prefixes[1]}]"
    cfg = tiny_config(**{"data.paths": paths, "train.train_iters": "300"})
    train, valid, _ = build_datasets(cfg, BYTE)
    assert isinstance(train, BlendedDataset) and len(train) >= 300 * 4
    counts = np.bincount(train.dataset_index, minlength=2)
    assert np.all(np.abs(counts - np.array([0.7, 0.3]) * len(train)) < 1)
    assert all(len(part) >= c for part, c in zip(train.datasets, counts))
    sample = train[0]
    assert sample["input_ids"].shape == (32,) and sample["loss_mask"].dtype == np.float32
    assert len(valid) > 0


def test_fim_and_best_fit_from_config(tiny_config, byte_prefixes):
    fim = tiny_config(**{"data.paths": f"[{byte_prefixes[0]}]", "data.fim_rate": "1.0"})
    train = build_datasets(fim, BYTE)[0]
    assert isinstance(train, GPTFIMDataset)
    sentinels = {BYTE.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")}
    assert any(sentinels <= set(train[i]["input_ids"].tolist()) for i in range(len(train)))

    packed = tiny_config(**{"data.paths": f"[{byte_prefixes[0]}]", "data.packing": "best_fit",
                            "data.fim_rate": "0.5"})
    train = build_datasets(packed, BYTE)[0]
    assert isinstance(train, PackedDataset) and train.transform is not None
    s = train[0]
    assert {"document_ids", "position_ids"} <= set(s) and s["input_ids"].shape == (32,)


def test_user_errors_name_the_field(tiny_config, byte_prefixes, tmp_path):
    with pytest.raises(ConfigError, match="data.paths.*not found"):
        build_datasets(tiny_config(**{"data.paths": f"[{tmp_path / 'missing'}]"}), BYTE)
    other = write_indexed(tmp_path / "big", [[1, 2, 3]], vocab_size=70000)
    with pytest.raises(ConfigError, match="vocab_size 70000"):
        build_datasets(tiny_config(**{"data.paths": f"[{other.prefix}]"}), BYTE)
    with pytest.raises(ConfigError, match="data.fim_prefix_token"):
        build_datasets(tiny_config(**{"data.paths": f"[{byte_prefixes[0]}]", "data.fim_rate": "0.5",
                                      "data.fim_prefix_token": "<|nope|>"}), BYTE)
    tiny = write_indexed(tmp_path / "tiny", [[], []], vocab_size=BYTE.vocab_size)
    with pytest.raises(ConfigError, match="no training samples"):
        build_datasets(tiny_config(**{"data.paths": f"[{tiny.prefix}]"}), BYTE)


def test_training_on_a_bpe_blend(tiny_config, tmp_path, jsonl_file, bpe_dir):
    from meshtron.training import Trainer

    cfg_tok = tokenizer_config_for(str(bpe_dir))
    prefixes = []
    for k, (key, eod) in enumerate((("text", True), ("text", False))):
        out = str(tmp_path / f"bpe{k}")
        preprocess(PreprocessOptions([str(jsonl_file)], out, cfg_tok, json_key=key, append_eod=eod, progress=False))
        prefixes.append(out)
    cfg = tiny_config(**{"tokenizer.type": "hf", "tokenizer.path": str(bpe_dir),
                         "data.paths": f"[0.6, {prefixes[0]}, 0.4, {prefixes[1]}]", "data.fim_rate": "0.5",
                         "train.train_iters": "3", "checkpoint.save_at_end": "false"})
    history = Trainer(cfg, echo=False).train()
    assert len(history) == 3 and all(math.isfinite(r.loss) for r in history)
    tok = build_tokenizer(cfg.tokenizer)
    assert history[0].loss == pytest.approx(math.log(tok.vocab_size), rel=0.15)   # untrained: near uniform


def _byte_data(path, ids_from: int, ids_to: int, num_docs: int = 40, eod: bool = True):
    rng = np.random.default_rng(5)
    docs = [rng.integers(ids_from, ids_to, size=50).tolist() + [BYTE.eod_id] * eod for _ in range(num_docs)]
    return str(write_indexed(path, docs, vocab_size=BYTE.vocab_size).prefix)


def test_ids_beyond_the_model_vocabulary_are_refused_before_training(tiny_config, tmp_path):
    """Issue 16: ids >= model.vocab_size used to reach the embedding (IndexError on CPU, a device
    assert on a GPU); the recorded maximum id is now checked when the datasets are built."""
    from meshtron.training import Trainer

    prefix = _byte_data(tmp_path / "hi", 200, 256)   # ids up to 255 plus eod 256: max 256
    run = {"data.paths": f"[{prefix}]", "data.split": "1,0,0", "train.train_iters": "1",
           "checkpoint.save_at_end": "false", "model.make_vocab_size_divisible_by": "1"}
    with pytest.raises(ConfigError, match=rf"data.paths: {prefix} holds token ids up to 256 but model.vocab_size "
                                          r"is 200; make it at least 257"):
        Trainer(tiny_config(**run, **{"model.vocab_size": "200"}))
    assert len(Trainer(tiny_config(**run, **{"model.vocab_size": "257"})).train()) == 1
    # The maximum decides, not the tokenizer's size: ids below 100 train on a 200-id model.
    low = _byte_data(tmp_path / "lo", 0, 100, eod=False)
    assert IndexedDataset(low).max_token_id == 99
    run["data.paths"] = f"[{low}]"
    assert len(Trainer(tiny_config(**run, **{"model.vocab_size": "200"})).train()) == 1


def test_corrupted_ids_stop_training_before_the_embedding(tiny_config, tmp_path):
    """A same-size corruption of the .bin is not in the recorded maximum: reads refuse the id."""
    from meshtron.training import Trainer

    prefix = _byte_data(tmp_path / "a", 0, 256)
    for doc in range(40):
        set_token(prefix, doc * 51 + 10, 60000)
    trainer = Trainer(tiny_config(**{"data.paths": f"[{prefix}]", "data.split": "1,0,0", "train.train_iters": "1",
                                     "checkpoint.save_at_end": "false"}))
    with pytest.raises(IndexedDatasetError, match=r"a\.bin: document \d+ holds token id 60000, outside the "
                                                  r"vocabulary of 262"):
        trainer.train()


def test_old_dataset_without_recorded_maximum(tiny_config, tmp_path):
    """No recorded maximum: trains silently when its vocab_size fits the model; warns when the model is
    smaller, and then a read of an id the model lacks is refused."""
    prefix = _byte_data(tmp_path / "a", 100, 256)
    rewrite_idx(prefix, max_id_field=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train, _, _ = build_datasets(tiny_config(**{"data.paths": f"[{prefix}]", "data.split": "1,0,0"}), BYTE)
    assert train[0]["input_ids"].max() < BYTE.vocab_size
    cfg = tiny_config(**{"data.paths": f"[{prefix}]", "data.split": "1,0,0", "model.vocab_size": "100"})
    with pytest.warns(UserWarning, match=rf"{prefix} has no recorded maximum token id .* exceeds model.vocab_size 100"):
        train, _, _ = build_datasets(cfg, BYTE)
    with pytest.raises(IndexedDatasetError, match="outside the vocabulary of 100"):
        train[0]
