"""Families added from outside meshtron (issue 20): an installed distribution's entry point in group
`meshtron.hf_families`, found by `meshtron convert` in a fresh process, and `register_family` in-process.
The reference is transformers: a checkpoint whose config names an architecture meshtron does not ship
(`MyLlamaForCausalLM`, a Llama under another name) converts once its family is declared, and gives the
logits of transformers' Llama on the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from meshtron.models.hf import ConversionError, adapter_for_hf, hf_to_meshtron, register_family
from meshtron.models.hf.adapter import FAMILIES
from tests.models.hf.conftest import load_hf
from tests.models.hf.test_families import TOL, load_meshtron

PLUGIN = '''
from meshtron.models.hf.llama import LlamaLikeAdapter


class MyLlamaAdapter(LlamaLikeAdapter):
    def __init__(self):
        super().__init__("myllama", "MyLlamaForCausalLM", bias_style="llama")
'''


def renamed_llama(hf_dirs, tmp_path):
    """The llama test model with config.json naming MyLlamaForCausalLM."""
    out = tmp_path / "myllama"
    out.mkdir()
    for f in hf_dirs["llama"].iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["MyLlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_plugin(root):
    (root / "myllama_plugin").mkdir(parents=True)
    (root / "myllama_plugin" / "__init__.py").write_text(PLUGIN)
    info = root / "myllama_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myllama-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[meshtron.hf_families]\nmyllama = myllama_plugin:MyLlamaAdapter\n")


def test_an_entry_point_family_converts_in_a_fresh_process(hf_dirs, tmp_path):
    source = renamed_llama(hf_dirs, tmp_path)
    with pytest.raises(ConversionError, match="MyLlamaForCausalLM"):
        adapter_for_hf(json.loads((source / "config.json").read_text()))
    write_plugin(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.getcwd()]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "meshtron", "convert", "hf-to-meshtron", "--hf-dir", str(source),
                           "--output", str(tmp_path / "ckpt")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    model = load_meshtron(tmp_path / "ckpt")
    tokens = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(tokens) - load_hf(hf_dirs["llama"])(tokens).logits).abs().max().item()
    assert diff <= TOL, diff


def test_register_family_in_process(hf_dirs, tmp_path, monkeypatch):
    from meshtron.models.hf.llama import LlamaLikeAdapter

    monkeypatch.setattr(FAMILIES, "registered", {})
    source = renamed_llama(hf_dirs, tmp_path)
    register_family(LlamaLikeAdapter("myllama", "MyLlamaForCausalLM", bias_style="llama"))
    model = load_meshtron(hf_to_meshtron(source, tmp_path / "ckpt"))
    tokens = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (model(tokens) - load_hf(hf_dirs["llama"])(tokens).logits).abs().max().item()
    assert diff <= TOL, diff
    with pytest.raises(TypeError, match="lacks"):
        register_family(object())
