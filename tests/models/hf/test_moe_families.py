"""Mixtral, Qwen3-MoE, DeepSeek-V3 and GPT-OSS converted HF -> meshtron: logits equal transformers'
(fp32, <= 1e-5) on plain and packed batches, greedy continuations match; meshtron -> HF gives back
every on-disk tensor (per-expert files, fused GPT-OSS experts) bit for bit and the same config; a
meshtron MoE model without a HF origin exports to a directory transformers loads with the same logits."""

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
from meshtron.nn.context import KVCacheContext, PackedContext
from tests.models.hf.conftest import load_hf, transformers
from tests.models.hf.test_families import TOL, load_meshtron, read_safetensors

COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, max_position_embeddings=64,
              initializer_range=0.2)


def configs() -> dict:
    return {
        # softmax over the top-2 logits, sliding window on every layer
        "mixtral": transformers.MixtralConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2, intermediate_size=16,
                                              num_local_experts=4, num_experts_per_tok=2, sliding_window=5),
        # QK-norm; a dense middle layer (mlp_only_layers); top-2 of the full softmax, not renormalised
        "qwen3_moe": transformers.Qwen3MoeConfig(**COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=8,
                                                 intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                                 num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False),
        # MLA with a query latent; first layer dense; 8 experts in 4 groups, 2 groups per token, top-4,
        # sigmoid with expert bias, scaling 2.5; one shared expert
        "deepseek_v3": transformers.DeepseekV3Config(
            **COMMON, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
            q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
            n_shared_experts=1, routed_scaling_factor=2.5, tie_word_embeddings=False),
        # sinks, sliding window on every other layer, YaRN (no truncation), biases, clamped GLU (low clamp so it acts)
        "gpt_oss": transformers.GptOssConfig(
            **COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 16, "truncate": False}),
    }


NAMES = sorted(configs())


def build(config, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # move what init leaves at 1 or 0 (norms, biases, sinks, expert bias) so a swap would show
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(("bias", "sinks")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("router.weight") or name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    out = {}
    for name, config in configs().items():
        build(config).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name, dirs, tmp_path):
    hf = load_hf(dirs[name])
    model = load_meshtron(hf_to_meshtron(dirs[name], tmp_path / "ckpt"))
    assert "E" in model.cfg.pattern
    torch.manual_seed(1)
    tokens = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= TOL, diff
    docs = [torch.randint(0, 96, (1, n)) for n in (7, 4, 9)]
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
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=8, do_sample=False)[0, 9:].tolist()
        ctx, tokens, ours = KVCacheContext(1, 17), prompt, []
        for _ in range(8):
            next_id = model(tokens, ctx.begin(tokens))[:, -1].argmax(-1, keepdim=True)
            ctx.advance()
            ours.append(int(next_id))
            tokens = next_id
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
        for name_, b in model.named_buffers():
            if name_.endswith("expert_bias"):
                b.normal_(0.0, 0.05)
    CheckpointManager(tmp_path / "ckpt").save(7, model, None, {"step": 7}, yaml.safe_dump(config_to_dict(cfg)))
    meshtron_to_hf(tmp_path / "ckpt", tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert adapter_for_hf(exported).name == name
    assert architecture_fields(adapter_for_hf(exported).to_model_config(exported)) == architecture_fields(cfg.model)
    hf = load_hf(tmp_path / "out")
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= TOL


def test_unconvertible_settings_name_the_field(dirs):
    hf_cfg = json.loads((dirs["deepseek_v3"] / "config.json").read_text())
    bad = {**hf_cfg, "topk_group": 1}
    with pytest.raises(ConversionError, match="num_experts_per_tok=4 is not supported for deepseek_v3"):
        adapter_for_hf(bad).to_model_config(bad)
    cfg = adapter_for_hf(hf_cfg).to_model_config(hf_cfg)
    cfg.moe_router_score_function = "softmax"
    with pytest.raises(ConversionError, match="model.moe_router_score_function='softmax' cannot be written as Deepseek"):
        adapter_for_hf(hf_cfg).to_hf_config(cfg)
    mixtral = json.loads((dirs["mixtral"] / "config.json").read_text())
    cfg = adapter_for_hf(mixtral).to_model_config(mixtral)
    cfg.moe_layer_freq = 2
    with pytest.raises(ConversionError, match="model.layer_pattern='\\*E\\*-' cannot be written as MixtralForCausalLM"):
        adapter_for_hf(mixtral).to_hf_config(cfg)


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_init_from_hf_fills_stacked_experts(name, dirs):
    from meshtron.config.schema import ModelConfig
    from meshtron.models.hf import init_model_from_hf

    _, model = init_model_from_hf(dirs[name], ModelConfig(), 96, torch.device("cpu"))
    hf = load_hf(dirs[name])
    tokens = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        assert (model.eval()(tokens) - hf(tokens).logits).abs().max().item() <= TOL
