"""Training from Hugging Face weights: `train.init_from_hf` starts from exactly the HF model, one step
later the export loads back into transformers with meshtron's logits; and a converted checkpoint
resumes through `checkpoint.load` (weights only, fresh optimizer, step 0)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshtron.config import load_config
from meshtron.models.hf import hf_to_meshtron, meshtron_to_hf, supported_architectures
from meshtron.training import Trainer
from tests.conftest import TINY
from tests.models.hf.conftest import build_hf_model, load_hf, transformers

# The byte tokenizer has 262 ids, so the HF model needs at least that many.
VOCAB = 272


def llama_dir(tmp_path):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.2)
    build_hf_model(config).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def logits_diff(model, hf, tokens) -> float:
    model.eval()
    with torch.no_grad():
        return (model(tokens) - hf(tokens).logits).abs().max().item()


def test_init_from_hf_train_one_step_and_export(tmp_path):
    hf_dir = llama_dir(tmp_path)
    overrides = {**TINY, "train.run_dir": str(tmp_path / "run"), "train.init_from_hf": str(hf_dir),
                 "train.train_iters": "1", "model.hidden_dropout": "0.0", "optimizer.lr": "1e-2",
                 "scheduler.warmup_steps": "0"}
    trainer = Trainer(load_config(overrides=overrides), echo=False)
    assert trainer.cfg.model.hidden_size == 32 and trainer.cfg.model.vocab_size == VOCAB  # from config.json
    tokens = torch.randint(0, VOCAB, (2, 16))
    assert logits_diff(trainer.model, load_hf(hf_dir), tokens) <= 1e-5  # starts exactly at the HF weights
    trainer.train()
    meshtron_to_hf(tmp_path / "run" / "checkpoints", tmp_path / "trained")
    trained = load_hf(tmp_path / "trained")
    assert logits_diff(trainer.model, trained, tokens) <= 1e-5
    assert logits_diff(trainer.model, load_hf(hf_dir), tokens) > 1e-3  # the step changed the weights


def test_resume_training_from_a_converted_checkpoint(tmp_path):
    hf_dir = llama_dir(tmp_path)
    step_dir = hf_to_meshtron(hf_dir, tmp_path / "ckpt")
    overrides = {k: v for k, v in TINY.items() if not k.startswith("model.")}
    overrides.update({"train.run_dir": str(tmp_path / "run"), "checkpoint.load": str(tmp_path / "ckpt"),
                      "train.train_iters": "1", "tokenizer.type": "byte", "tokenizer.path": "null"})
    trainer = Trainer(load_config(step_dir / "config.yaml", overrides), echo=False)
    assert trainer.step == 0
    assert logits_diff(trainer.model, load_hf(hf_dir), torch.randint(0, VOCAB, (1, 12))) <= 1e-5
    history = trainer.train()
    assert len(history) == 1 and not history[0].skipped


def cli_train_error(hf_dir, tmp_path, capsys) -> tuple[int, list[str]]:
    """`meshtron train --train.init_from_hf hf_dir` in-process: (exit status, stderr lines)."""
    from meshtron.cli import main

    flags = [f"--{k}={v}" for k, v in TINY.items() if not k.startswith("model.")]
    capsys.readouterr()
    code = main(["train", *flags, f"--train.run_dir={tmp_path / 'run'}", f"--train.init_from_hf={hf_dir}",
                 "--train.train_iters=1"])
    return code, capsys.readouterr().err.strip().splitlines()


def test_cli_unsupported_architecture_is_one_line(tmp_path, capsys):
    hf_dir = llama_dir(tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    code, err = cli_train_error(hf_dir, tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: train.init_from_hf: ") and "'BertForMaskedLM'" in err[0]
    assert all(arch in err[0] for arch in supported_architectures())


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_cli_missing_or_unexpected_tensor_is_one_line(tmp_path, capsys, change):
    hf_dir = llama_dir(tmp_path)
    tensors = load_file(hf_dir / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight" if change == "missing" else "model.layers.1.mlp.extra.weight"
    if change == "missing":
        del tensors[name]
    else:
        tensors[name] = torch.zeros(3, 3)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    code, err = cli_train_error(hf_dir, tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: train.init_from_hf: ") and repr(name) in err[0] and change in err[0]
