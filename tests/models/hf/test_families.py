"""Every supported family, converted HF -> meshtron: logits equal transformers' (fp32, <= 1e-5) on
plain and packed batches; meshtron -> HF gives back the same tensors bit for bit and the same
config; a meshtron model without a HF origin exports to a directory transformers loads with the
same logits."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors import safe_open

from meshtron.checkpoint import CheckpointManager, load_checkpoint, read_checkpoint_config
from meshtron.config.loader import config_from_dict, config_to_dict
from meshtron.config.schema import RunConfig
from meshtron.models import GPTModel
from meshtron.models.hf import adapter_for_hf, hf_to_meshtron, meshtron_to_hf
from meshtron.models.hf.adapter import architecture_fields
from meshtron.nn.context import PackedContext
from tests.models.hf.conftest import FAMILIES, build_hf_model, family_configs, load_hf

TOL = 1e-5


def load_meshtron(checkpoint) -> GPTModel:
    cfg = config_from_dict(yaml.safe_load(read_checkpoint_config(checkpoint)))
    model = GPTModel(cfg.model).eval()
    load_checkpoint(checkpoint, model)
    return model


def read_safetensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, hf_dirs, tmp_path):
    hf = load_hf(hf_dirs[family])
    model = load_meshtron(hf_to_meshtron(hf_dirs[family], tmp_path / "ckpt"))
    torch.manual_seed(1)
    tokens = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= TOL, diff
    # padding-free packing: three documents in one row, positions restarting, against separate HF forwards
    docs = [torch.randint(0, 96, (1, n)) for n in (7, 4, 9)]
    packed = torch.cat(docs, 1)
    ctx = PackedContext.for_tokens(packed, torch.cat([torch.full((d.shape[1],), i) for i, d in enumerate(docs)])[None],
                                   torch.cat([torch.arange(d.shape[1]) for d in docs])[None])
    with torch.no_grad():
        diff = (model(packed, ctx) - torch.cat([hf(d).logits for d in docs], 1)).abs().max().item()
    assert diff <= TOL, diff


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact(family, hf_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    hf_to_meshtron(hf_dirs[family], ckpt)
    out = tmp_path / "back"
    meshtron_to_hf(ckpt, out, max_shard_bytes=20_000)  # small shards: several files and an index
    original, back = read_safetensors(hf_dirs[family]), read_safetensors(out)
    assert original.keys() == back.keys()
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dirs[family] / "config.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())


def test_bf16_round_trip_is_bit_exact(tmp_path):
    build_hf_model(family_configs()["llama"]).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    hf_to_meshtron(tmp_path / "hf", tmp_path / "ckpt")
    meshtron_to_hf(tmp_path / "ckpt", tmp_path / "back")
    original, back = read_safetensors(tmp_path / "hf"), read_safetensors(tmp_path / "back")
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], v) for k, v in original.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("family", FAMILIES)
def test_export_without_hf_origin(family, hf_dirs, tmp_path):
    """A model that meshtron trained (no carried config.json) exports under a guessed family."""
    hf_cfg = json.loads((hf_dirs[family] / "config.json").read_text())
    cfg = RunConfig()
    cfg.model = adapter_for_hf(hf_cfg).to_model_config(hf_cfg)
    torch.manual_seed(3)
    model = GPTModel(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    CheckpointManager(tmp_path / "ckpt").save(7, model, None, {"step": 7}, yaml.safe_dump(config_to_dict(cfg)))
    meshtron_to_hf(tmp_path / "ckpt", tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert adapter_for_hf(exported).name == family
    assert architecture_fields(adapter_for_hf(exported).to_model_config(exported)) == architecture_fields(cfg.model)
    hf = load_hf(tmp_path / "out")
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= TOL
