"""Mamba-2 and the NemotronH hybrid (Mamba + attention + MLP, and with MoE blocks), converted HF -> meshtron: logits equal
transformers' (fp32, <= 1e-5) on plain and packed batches, and greedy continuations match; meshtron ->
HF gives back every tensor bit for bit and the same config; a meshtron hybrid without a HF origin
exports to a directory transformers loads with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from meshtron.checkpoint import CheckpointManager
from meshtron.config.loader import config_to_dict
from meshtron.config.schema import RunConfig
from meshtron.models import GPTModel
from meshtron.models.hf import ConversionError, adapter_for_hf, hf_to_meshtron, meshtron_to_hf
from meshtron.models.hf.adapter import architecture_fields
from meshtron.nn.context import PackedContext
from tests.models.hf.conftest import greedy_pair, load_hf, transformers
from tests.models.hf.test_families import TOL, load_meshtron, read_safetensors

MAMBA = dict(vocab_size=96, hidden_size=32, n_groups=2, chunk_size=8, conv_kernel=4)


def configs() -> dict:
    return {
        # 8 heads of 8 = expand 2; conv bias, projection biases, a dt clamp from below, untied head
        "mamba2": transformers.Mamba2Config(**MAMBA, num_heads=8, head_dim=8, state_size=6, num_hidden_layers=3,
                                            use_bias=True, time_step_limit=(0.01, float("inf"))),
        # Mamba / MLP / attention / Mamba / MLP; GQA without RoPE, relu2 MLP, 6 heads of 8 (not a multiple of 32)
        "nemotron_h": transformers.NemotronHConfig(
            **MAMBA, layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=6,
            mamba_head_dim=8, ssm_state_size=5, use_conv_bias=False, max_position_embeddings=64, initializer_range=0.2),
        # with MoE blocks: 8 relu2 experts in 2 groups (a token may use 1 group: top-2 of its 4), expert bias,
        # shared expert, routed_scaling_factor
        "nemotron_h_moe": transformers.NemotronHConfig(
            **MAMBA, layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "moe", "mlp"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8,
            mamba_head_dim=8, ssm_state_size=5, max_position_embeddings=64, initializer_range=0.2,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=24, routed_scaling_factor=1.5),
    }


NAMES = sorted(configs())


def build(config, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # move what init leaves at 1, 0 or arange, so that a swapped tensor would show
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(("bias", ".D", ".A_log", ".dt_bias")):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_mamba")
    out = {}
    for name, config in configs().items():
        build(config).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name, dirs, tmp_path):
    hf = load_hf(dirs[name])
    model = load_meshtron(hf_to_meshtron(dirs[name], tmp_path / "ckpt"))
    torch.manual_seed(1)
    tokens = torch.randint(0, 96, (2, 21))  # 3 chunks of 8, the last one partial
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= TOL, diff
    docs = [torch.randint(0, 96, (1, n)) for n in (7, 4, 11)]
    packed = torch.cat(docs, 1)
    ctx = PackedContext.for_tokens(packed, torch.cat([torch.full((d.shape[1],), i) for i, d in enumerate(docs)])[None],
                                   torch.cat([torch.arange(d.shape[1]) for d in docs])[None])
    with torch.no_grad():
        diff = (model(packed, ctx) - torch.cat([hf(d).logits for d in docs], 1)).abs().max().item()
    assert diff <= TOL, diff


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decoding_matches_transformers_generate(name, dirs, tmp_path):
    hf = load_hf(dirs[name])
    model = load_meshtron(hf_to_meshtron(dirs[name], tmp_path / "ckpt"))
    expected, ours = greedy_pair(hf, model)
    assert ours == expected


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bit_exact(name, dirs, tmp_path):
    hf_to_meshtron(dirs[name], tmp_path / "ckpt")
    meshtron_to_hf(tmp_path / "ckpt", tmp_path / "back", max_shard_bytes=30_000)
    original, back = read_safetensors(dirs[name]), read_safetensors(tmp_path / "back")
    assert original.keys() == back.keys()
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        json.loads((dirs[name] / "config.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_export_without_hf_origin(name, dirs, tmp_path):
    hf_cfg = json.loads((dirs[name] / "config.json").read_text())
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
    assert adapter_for_hf(exported).name == name.removesuffix("_moe")
    assert architecture_fields(adapter_for_hf(exported).to_model_config(exported)) == architecture_fields(cfg.model)
    hf = load_hf(tmp_path / "out")
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= TOL


def test_unconvertible_settings_name_the_field(dirs):
    hf_cfg = json.loads((dirs["nemotron_h"] / "config.json").read_text())
    with pytest.raises(ConversionError, match="mlp_hidden_act='silu' is not supported for nemotron_h"):
        adapter_for_hf({**hf_cfg, "mlp_hidden_act": "silu"}).to_model_config({**hf_cfg, "mlp_hidden_act": "silu"})
    cfg = adapter_for_hf(hf_cfg).to_model_config(hf_cfg)
    cfg.mamba_dt_limit_max = 1.0
    with pytest.raises(ConversionError, match="model.mamba_dt_limit_min=.* cannot be written as NemotronHForCausalLM"):
        adapter_for_hf(hf_cfg).to_hf_config(cfg)


def test_init_from_hf_trains_a_hybrid_and_exports_it(tmp_path):
    """`train.init_from_hf` on NemotronH starts at the HF logits; after a step the export loads back
    into transformers with meshtron's logits."""
    from meshtron.config import load_config
    from meshtron.training import Trainer
    from tests.conftest import TINY

    config = configs()["nemotron_h"]
    config.vocab_size = 272  # the byte tokenizer's 262 ids fit
    build(config).save_pretrained(tmp_path / "hf")
    overrides = {**TINY, "train.run_dir": str(tmp_path / "run"), "train.init_from_hf": str(tmp_path / "hf"),
                 "train.train_iters": "1", "optimizer.lr": "1e-2", "scheduler.warmup_steps": "0",
                 "data.seq_length": "32"}
    trainer = Trainer(load_config(overrides=overrides), echo=False)
    assert trainer.cfg.model.pattern == "M-*M-"
    tokens = torch.randint(0, 262, (2, 16))

    def diff(hf) -> float:
        trainer.model.eval()
        with torch.no_grad():
            return (trainer.model(tokens) - hf(tokens).logits).abs().max().item()

    assert diff(load_hf(tmp_path / "hf")) <= TOL
    trainer.train()
    meshtron_to_hf(tmp_path / "run" / "checkpoints", tmp_path / "trained")
    assert diff(load_hf(tmp_path / "trained")) <= TOL
    assert diff(load_hf(tmp_path / "hf")) > 1e-3
