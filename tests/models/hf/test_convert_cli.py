"""`meshtron convert` end to end: both verbs, tokenizer files carried both ways (and `meshtron
generate` on a converted checkpoint), and one-line errors for an unsupported architecture, a
missing, unexpected or misshapen tensor, and a model a family cannot express."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from meshtron.checkpoint import CheckpointManager
from meshtron.cli import main
from meshtron.config.loader import config_to_dict
from meshtron.config.schema import RunConfig
from meshtron.models import GPTModel
from meshtron.models.hf import ConversionError, hf_to_meshtron, meshtron_to_hf
from tests.models.hf.test_families import load_meshtron, read_safetensors


def write_char_tokenizer(directory):
    """A character-level tokenizer.json (ids below the tiny models' vocabulary of 96) with an eos token."""
    from tokenizers import Tokenizer, models

    chars = "abcdefghijklmnopqrstuvwxyz ._\n"
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def test_cli_round_trip_with_tokenizer_and_generate(hf_dirs, tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_dirs["qwen3"], hf_dir)
    write_char_tokenizer(hf_dir)
    assert main(["convert", "hf-to-meshtron", "--hf-dir", str(hf_dir), "--output", str(tmp_path / "ckpt")]) == 0
    cfg = yaml.safe_load((tmp_path / "ckpt" / "step_00000000" / "config.yaml").read_text())
    assert cfg["tokenizer"]["type"] == "hf" and (tmp_path / "ckpt/step_00000000/hf/tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "abc", "--max-new-tokens", "5",
                 "--seed", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("abc")
    assert main(["convert", "meshtron-to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
                 "--max-shard-size", "10KB"]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (hf_dir / name).read_bytes()
    original, back = read_safetensors(hf_dir), read_safetensors(tmp_path / "out")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    # the sharded export (with its index) reads back into the same meshtron weights
    again = load_meshtron(hf_to_meshtron(tmp_path / "out", tmp_path / "ckpt2")).state_dict()
    first = load_meshtron(tmp_path / "ckpt").state_dict()
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def expect_one_line(capsys, argv, *fragments):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err


def test_unsupported_architecture(hf_dirs, tmp_path, capsys):
    shutil.copytree(hf_dirs["llama"], tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    expect_one_line(capsys, ["convert", "hf-to-meshtron", "--hf-dir", str(tmp_path / "hf"), "--output",
                             str(tmp_path / "ckpt")], "'BertForMaskedLM' is not supported",
                    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel")


@pytest.mark.parametrize("edit,fragment", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
     "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
    (lambda t: t.update({"model.norm.weight": torch.ones(31)}),
     "tensor 'model.norm.weight' has shape [31], expected [32]"),
])
def test_bad_tensors_are_named(hf_dirs, tmp_path, capsys, edit, fragment):
    shutil.copytree(hf_dirs["llama"], tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    expect_one_line(capsys, ["convert", "hf-to-meshtron", "--hf-dir", str(tmp_path / "hf"), "--output",
                             str(tmp_path / "ckpt")], fragment)
    assert not (tmp_path / "ckpt" / "latest").exists()  # nothing half-written


def test_missing_safetensors(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                                                             "num_attention_heads": 2, "num_hidden_layers": 1,
                                                             "intermediate_size": 8, "vocab_size": 8,
                                                             "max_position_embeddings": 8}))
    expect_one_line(capsys, ["convert", "hf-to-meshtron", "--hf-dir", str(tmp_path / "hf"), "--output",
                             str(tmp_path / "ckpt")], "has neither model.safetensors nor model.safetensors.index.json")


def test_unrepresentable_model_names_the_field(hf_dirs, tmp_path, capsys):
    hf_to_meshtron(hf_dirs["llama"], tmp_path / "ckpt")
    expect_one_line(capsys, ["convert", "meshtron-to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--output",
                             str(tmp_path / "out"), "--architecture", "gpt2"],
                    "model.position_embedding_type='rope' cannot be written as GPT2LMHeadModel")
    run = RunConfig()
    run.model.vocab_size, run.model.softmax_type = 64, "learnable"
    CheckpointManager(tmp_path / "sinks").save(1, GPTModel(run.model), None, {"step": 1},
                                               yaml.safe_dump(config_to_dict(run)))
    with pytest.raises(ConversionError, match="model.softmax_type='learnable' cannot be written as LlamaForCausalLM"):
        meshtron_to_hf(tmp_path / "sinks", tmp_path / "out2")


def test_mtp_weights_are_dropped_with_a_note(hf_dirs, tmp_path):
    step = hf_to_meshtron(hf_dirs["llama"], tmp_path / "ckpt")
    run = yaml.safe_load((step / "config.yaml").read_text())
    run["model"]["mtp_num_layers"] = 1
    model = load_meshtron(tmp_path / "ckpt")
    mtp_cfg = model.cfg.__class__(**{**run["model"]})
    with_mtp = GPTModel(mtp_cfg)
    with_mtp.load_state_dict(model.state_dict(), strict=False)
    CheckpointManager(tmp_path / "mtp").save(3, with_mtp, None, {"step": 3}, yaml.safe_dump(run))
    notes = meshtron_to_hf(tmp_path / "mtp", tmp_path / "out", architecture="llama")
    assert len(notes) == 2 and "multi-token prediction" in notes[0]  # and: no tokenizer files to carry
    original, back = read_safetensors(hf_dirs["llama"]), read_safetensors(tmp_path / "out")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
