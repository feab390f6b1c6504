"""Multi-latent attention against transformers' DeepSeek-V3 with every layer dense: the same weights
give the same logits (fp32, <= 1e-5), with and without a query latent, with interleaved or
rotate-half RoPE, and with YaRN (which also rescales MLA's softmax)."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.models import GPTModel
from meshtron.nn.context import PackedContext
from tests.models.hf.pin import import_transformers

transformers = import_transformers()

LAYERS = 2


def deepseek(q_lora_rank, interleave, yarn):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=5, first_k_dense_replace=LAYERS, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=64, rms_norm_eps=1e-6, rope_interleave=interleave,
        rope_parameters=rope, tie_word_embeddings=False, attention_bias=False)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random norm weights, so that a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def meshtron_config(q_lora_rank, interleave, yarn) -> ModelConfig:
    kw = dict(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=64,
              make_vocab_size_divisible_by=1, max_position_embeddings=64, norm_epsilon=1e-6,
              multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_head_dim=6,
              qk_pos_emb_head_dim=4, v_head_dim=5, rotary_interleaved=interleave)
    if yarn:
        kw.update(position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16,
                  yarn_mscale=1.0, yarn_mscale_all_dim=1.0)
    cfg = ModelConfig(**kw)
    cfg.validate()
    return cfg


def deepseek_state_to_meshtron(hf_state: dict) -> dict:
    names = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
             "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo",
             "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
    out = {"embedding.weight": hf_state["model.embed_tokens.weight"], "final_norm.weight": hf_state["model.norm.weight"],
           "output.weight": hf_state["lm_head.weight"]}
    for key, value in hf_state.items():
        parts = key.split(".")
        if parts[:2] != ["model", "layers"]:
            continue
        i, rest = int(parts[2]), parts[3:]
        if rest[0] == "input_layernorm":
            out[f"layers.{2 * i}.norm.weight"] = value
        elif rest[0] == "post_attention_layernorm":
            out[f"layers.{2 * i + 1}.norm.weight"] = value
        elif rest[0] == "self_attn":
            out[f"layers.{2 * i}.mixer.{names[rest[1]]}.{rest[2]}"] = value
        elif rest[0] == "mlp":
            out[f"layers.{2 * i + 1}.mixer.{names[rest[1]]}.{rest[2]}"] = value
    return out


@pytest.mark.parametrize("q_lora_rank,interleave,yarn", [(16, True, False), (None, False, False), (16, True, True)])
def test_mla_logits_match_deepseek_v3(q_lora_rank, interleave, yarn):
    hf = deepseek(q_lora_rank, interleave, yarn)
    model = GPTModel(meshtron_config(q_lora_rank, interleave, yarn)).eval()
    model.load_state_dict(deepseek_state_to_meshtron(hf.state_dict()))
    tokens = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        ref = hf(tokens).logits
        out = model(tokens)
    assert (out - ref).abs().max().item() <= 1e-5
    # packed: two documents with restarting positions equal two separate HF forwards
    a, b = torch.randint(0, 64, (1, 9)), torch.randint(0, 64, (1, 15))
    packed = torch.cat([a, b], 1)
    ctx = PackedContext.for_tokens(packed, torch.tensor([[0] * 9 + [1] * 15]),
                                   torch.cat([torch.arange(9), torch.arange(15)])[None])
    with torch.no_grad():
        out = model(packed, ctx)
        ref = torch.cat([hf(a).logits, hf(b).logits], 1)
    assert (out - ref).abs().max().item() <= 1e-5
