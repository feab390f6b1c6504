"""Config variants of the supported families that test_families / test_moe_families do not cover:
attention biases independent of MLP biases (Qwen3 and Llama with `attention_bias: true`, Llama with
`mlp_bias` only, GPT-OSS without attention biases), linear RoPE scaling (`rope_type: linear`) in
every family whose transformers model allows it, and Llama-3 / YaRN scaling of a 128k context. Each against transformers: logits (fp32, <= 1e-5),
also at positions near the end of a 128k context, greedy continuations equal `generate`'s, meshtron ->
HF gives back every tensor bit for bit and the same config.json, and a meshtron model without a HF
origin exports under the same family."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from meshtron.checkpoint import CheckpointManager
from meshtron.config.loader import config_to_dict
from meshtron.config.schema import RunConfig
from meshtron.models import GPTModel
from meshtron.models.hf import adapter_for_hf, hf_to_meshtron, meshtron_to_hf
from meshtron.models.hf.adapter import architecture_fields
from meshtron.nn.context import PackedContext
from tests.models.hf.conftest import greedy_pair, load_hf, transformers
from tests.models.hf.test_families import TOL, load_meshtron, read_safetensors
from tests.models.hf.test_moe_families import build

SMALL = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, initializer_range=0.2)
LONG = 131072
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def variants() -> dict:
    t = transformers
    return {
        # q/k/v and output biases, no MLP bias
        "qwen3_attention_bias": t.Qwen3Config(**SMALL, intermediate_size=48, num_key_value_heads=2, head_dim=8,
                                              max_position_embeddings=64, attention_bias=True),
        "llama_attention_bias": t.LlamaConfig(**SMALL, intermediate_size=48, num_key_value_heads=2,
                                              max_position_embeddings=64, attention_bias=True, mlp_bias=False),
        "llama_mlp_bias": t.LlamaConfig(**SMALL, intermediate_size=48, num_key_value_heads=2, max_position_embeddings=64,
                                        attention_bias=False, mlp_bias=True),
        # linear RoPE scaling, one per family that has it
        "llama_linear": t.LlamaConfig(**SMALL, intermediate_size=48, num_key_value_heads=2,
                                      max_position_embeddings=LONG, rope_parameters=dict(LINEAR)),
        "mistral_linear": t.MistralConfig(**SMALL, intermediate_size=48, num_key_value_heads=1, head_dim=16,
                                          sliding_window=5, max_position_embeddings=LONG, rope_parameters=dict(LINEAR)),
        "qwen2_linear": t.Qwen2Config(**SMALL, intermediate_size=48, num_key_value_heads=2,
                                      max_position_embeddings=LONG, rope_parameters=dict(LINEAR)),
        "qwen3_linear": t.Qwen3Config(**SMALL, intermediate_size=48, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=LONG, rope_parameters=dict(LINEAR)),
        "mixtral_linear": t.MixtralConfig(**SMALL, num_key_value_heads=2, intermediate_size=16, num_local_experts=4,
                                          num_experts_per_tok=2, max_position_embeddings=LONG,
                                          rope_parameters=dict(LINEAR)),
        "qwen3_moe_linear": t.Qwen3MoeConfig(**SMALL, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                                             moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                             max_position_embeddings=LONG, rope_parameters=dict(LINEAR)),
        "deepseek_v3_linear": t.DeepseekV3Config(
            **SMALL, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, q_lora_rank=16,
            kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, first_k_dense_replace=1,
            n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, tie_word_embeddings=False, max_position_embeddings=LONG,
            rope_parameters=dict(LINEAR)),
        # the float32 frequencies of Llama-3 and YaRN scaling, checked at the far end of the context
        "llama3_long": t.LlamaConfig(**SMALL, intermediate_size=48, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=LONG, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        "qwen2_yarn_long": t.Qwen2Config(**SMALL, intermediate_size=48, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=LONG, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}),
        # and without attention biases (its experts keep theirs)
        "gpt_oss_linear_no_attention_bias": t.GptOssConfig(
            **SMALL, num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.5, attention_bias=False,
            max_position_embeddings=LONG, rope_parameters=dict(LINEAR)),
    }


NAMES = sorted(variants())
FAST = {"qwen3_attention_bias", "llama_linear"}  # the default suite; the rest run with -m slow
PARAMS = [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in NAMES]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_variants")
    return {}, root


def hf_dir(dirs, name):
    """The saved transformers model of variant `name`, built on first use."""
    built, root = dirs
    if name not in built:
        build(variants()[name]).save_pretrained(root / name)
        built[name] = root / name
    return built[name]


@pytest.mark.parametrize("name", PARAMS)
def test_logits_match_transformers_near_and_far(name, dirs, tmp_path):
    directory = hf_dir(dirs, name)
    hf = load_hf(directory)
    model = load_meshtron(hf_to_meshtron(directory, tmp_path / "ckpt"))
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    starts = [0] + ([LONG - 16, 8192 - 8] if hf.config.max_position_embeddings == LONG else [])
    for start in starts:  # positions start..start+15 (the last one 131071 for the long-context variants)
        positions = torch.arange(start, start + 16).expand(2, -1)
        with torch.no_grad():
            ours = model(tokens, PackedContext.for_tokens(tokens, positions=positions))
            theirs = hf(tokens, position_ids=positions).logits
            # the rotation itself, bit for bit (GPT-OSS's module returns one half of the repeated cos/sin)
            (cos, sin), (hf_cos, hf_sin) = model.rotary(positions), hf.model.rotary_emb(torch.zeros(1), positions)
        half = hf_cos.shape[-1]
        assert torch.equal(cos[..., :half], hf_cos) and torch.equal(sin[..., :half], hf_sin), start
        diff = (ours - theirs).abs().max().item()
        assert diff <= TOL, (start, diff)


@pytest.mark.parametrize("name", PARAMS)
def test_greedy_decoding_matches_transformers_generate(name, dirs, tmp_path):
    directory = hf_dir(dirs, name)
    hf = load_hf(directory)
    model = load_meshtron(hf_to_meshtron(directory, tmp_path / "ckpt"))
    expected, ours = greedy_pair(hf, model)
    assert ours == expected


@pytest.mark.parametrize("name", PARAMS)
def test_round_trip_is_bit_exact(name, dirs, tmp_path):
    directory = hf_dir(dirs, name)
    hf_to_meshtron(directory, tmp_path / "ckpt")
    meshtron_to_hf(tmp_path / "ckpt", tmp_path / "back")
    original, back = read_safetensors(directory), read_safetensors(tmp_path / "back")
    assert original.keys() == back.keys()
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("name", PARAMS)
def test_export_without_hf_origin(name, dirs, tmp_path):
    """A meshtron-trained model with these settings exports under the same family, loadable by transformers."""
    hf_cfg = json.loads((hf_dir(dirs, name) / "config.json").read_text())
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
    assert adapter_for_hf(exported).name == adapter_for_hf(hf_cfg).name
    assert architecture_fields(adapter_for_hf(exported).to_model_config(exported)) == architecture_fields(cfg.model)
    hf = load_hf(tmp_path / "out")
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= TOL


def test_attention_bias_is_untied_from_the_mlp_bias(dirs):
    """Qwen3 attention_bias true reads as q/k/v and output biases without MLP biases (it was refused)."""
    hf_cfg = json.loads((hf_dir(dirs, "qwen3_attention_bias") / "config.json").read_text())
    cfg = adapter_for_hf(hf_cfg).to_model_config(hf_cfg)
    assert cfg.add_qkv_bias and cfg.attention_output_bias and not cfg.add_bias_linear
    model = GPTModel(cfg)
    assert model.layers[0].mixer.wo.bias is not None and model.layers[1].mixer.w_up.bias is None


def test_megatron_checkpoint_refuses_what_it_cannot_express(dirs):
    """Megatron has one switch for the attention-output and MLP biases and no linear RoPE scaling: writing
    either as a Megatron checkpoint is refused by field, not silently changed."""
    from meshtron.models.megatron.names import MegatronError, check_supported

    for name, field in (("qwen3_attention_bias", "model.add_bias_attention_output"),
                        ("llama_linear", "model.rope_scaling_type")):
        hf_cfg = json.loads((hf_dir(dirs, name) / "config.json").read_text())
        cfg = adapter_for_hf(hf_cfg).to_model_config(hf_cfg)
        with pytest.raises(MegatronError, match=field):
            check_supported(cfg)
