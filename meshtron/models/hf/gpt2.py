"""GPT-2: learned absolute positions, LayerNorm, GELU MLP, biases everywhere, tied head.

On disk (`transformer.` prefix as save_pretrained writes it; the original release has none):
    wte.weight, wpe.weight                 -> embedding.weight, position_embedding.weight
    h.{i}.ln_1.{weight,bias}               -> layers.{2i}.norm.*
    h.{i}.attn.c_attn.{weight,bias}        -> layers.{2i}.mixer.{wq,wk,wv}.*   (fused along the output dim)
    h.{i}.attn.c_proj.{weight,bias}        -> layers.{2i}.mixer.wo.*
    h.{i}.ln_2.{weight,bias}               -> layers.{2i+1}.norm.*
    h.{i}.mlp.c_fc / c_proj                -> layers.{2i+1}.mixer.w_up / w_down
    ln_f.{weight,bias}                     -> final_norm.*
GPT-2's Conv1D stores weights as (in, out), the transpose of a Linear weight.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from meshtron.config.schema import ModelConfig
from meshtron.models.hf.adapter import TensorMap, hf_require, require

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "quick_gelu": "quick_gelu"}
ACTIVATION_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "quick_gelu": "quick_gelu"}


class GPT2Adapter:
    name = "gpt2"
    architecture = "GPT2LMHeadModel"

    def to_model_config(self, hf: dict[str, Any]) -> ModelConfig:
        d, heads = hf["n_embd"], hf["n_head"]
        act = hf.get("activation_function", "gelu_new")
        hf_require(act in ACTIVATIONS, "activation_function", act, self.name, f"use one of {sorted(ACTIVATIONS)}")
        hf_require(not hf.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx", True,
                   self.name, "every layer must scale attention logits the same way")
        hf_require(not hf.get("add_cross_attention", False), "add_cross_attention", True, self.name,
                   "meshtron models are decoder-only")
        inner = hf.get("n_inner")
        return ModelConfig(
            num_layers=hf["n_layer"], hidden_size=d, num_attention_heads=heads,
            ffn_hidden_size=None if inner in (None, 4 * d) else inner, vocab_size=hf["vocab_size"],
            make_vocab_size_divisible_by=1, max_position_embeddings=hf["n_positions"],
            position_embedding_type="learned_absolute", normalization="LayerNorm",
            norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)), activation=ACTIVATIONS[act],
            add_bias_linear=True, add_qkv_bias=True,
            softmax_scale=None if hf.get("scale_attn_weights", True) else 1.0,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            attention_dropout=float(hf.get("attn_pdrop", 0.1)), hidden_dropout=float(hf.get("resid_pdrop", 0.1)))

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        target = self.architecture
        n = cfg.pattern.count("*")
        require(cfg.pattern == "*-" * n, "layer_pattern", cfg.pattern, target, "it alternates attention and MLP")
        require(cfg.position_embedding_type == "learned_absolute", "position_embedding_type",
                cfg.position_embedding_type, target, "it uses learned absolute positions")
        require(cfg.normalization == "LayerNorm", "normalization", cfg.normalization, target, "it uses LayerNorm")
        require(cfg.activation in ACTIVATION_NAMES, "activation", cfg.activation, target,
                f"it uses a plain MLP: {', '.join(ACTIVATION_NAMES)}")
        require(cfg.add_bias_linear and cfg.add_qkv_bias and cfg.attention_output_bias, "add_bias_linear",
                cfg.add_bias_linear, target, "every GPT-2 linear layer has a bias (add_bias_linear and add_qkv_bias "
                "true, add_bias_attention_output true or null)")
        require(cfg.num_kv_heads == cfg.num_attention_heads and not cfg.multi_latent_attention, "num_query_groups",
                cfg.num_query_groups, target, "it has one key/value head per query head")
        require(cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size, "kv_channels", cfg.kv_channels, target,
                "its heads split hidden_size evenly")
        require(not cfg.qk_layernorm and cfg.softmax_type == "vanilla" and cfg.window_size is None, "softmax_type",
                cfg.softmax_type, target, "it has no QK-norm, sinks or sliding window")
        require(cfg.softmax_scale in (None, 1.0, cfg.head_dim ** -0.5), "softmax_scale", cfg.softmax_scale, target,
                "it scales logits by 1/sqrt(head_dim) or not at all")
        return {
            "architectures": [self.architecture], "model_type": self.name, "vocab_size": cfg.vocab_size,
            "n_embd": cfg.hidden_size, "n_layer": n, "n_head": cfg.num_attention_heads,
            "n_inner": None if cfg.ffn_size == 4 * cfg.hidden_size else cfg.ffn_size,
            "n_positions": cfg.max_position_embeddings, "activation_function": ACTIVATION_NAMES[cfg.activation],
            "layer_norm_epsilon": cfg.norm_epsilon, "scale_attn_weights": cfg.softmax_scale != 1.0,
            "tie_word_embeddings": cfg.tie_word_embeddings, "attn_pdrop": cfg.attention_dropout,
            "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
        }

    def tensor_maps(self, cfg: ModelConfig, hf_keys: Optional[set[str]] = None) -> list[TensorMap]:
        prefix = "" if hf_keys is not None and "wte.weight" in hf_keys else "transformer."
        maps = [TensorMap(f"{prefix}wte.weight", ("embedding.weight",)),
                TensorMap(f"{prefix}wpe.weight", ("position_embedding.weight",))]
        for i in range(cfg.pattern.count("*")):
            a, m, p = f"layers.{2 * i}", f"layers.{2 * i + 1}", f"{prefix}h.{i}"
            qkv = tuple(f"{a}.mixer.{w}" for w in ("wq", "wk", "wv"))
            maps += [
                TensorMap(f"{p}.ln_1.weight", (f"{a}.norm.weight",)),
                TensorMap(f"{p}.ln_1.bias", (f"{a}.norm.bias",)),
                TensorMap(f"{p}.attn.c_attn.weight", tuple(f"{q}.weight" for q in qkv), transpose=True),
                TensorMap(f"{p}.attn.c_attn.bias", tuple(f"{q}.bias" for q in qkv)),
                TensorMap(f"{p}.attn.c_proj.weight", (f"{a}.mixer.wo.weight",), transpose=True),
                TensorMap(f"{p}.attn.c_proj.bias", (f"{a}.mixer.wo.bias",)),
                TensorMap(f"{p}.ln_2.weight", (f"{m}.norm.weight",)),
                TensorMap(f"{p}.ln_2.bias", (f"{m}.norm.bias",)),
                TensorMap(f"{p}.mlp.c_fc.weight", (f"{m}.mixer.w_up.weight",), transpose=True),
                TensorMap(f"{p}.mlp.c_fc.bias", (f"{m}.mixer.w_up.bias",)),
                TensorMap(f"{p}.mlp.c_proj.weight", (f"{m}.mixer.w_down.weight",), transpose=True),
                TensorMap(f"{p}.mlp.c_proj.bias", (f"{m}.mixer.w_down.bias",)),
            ]
        maps += [TensorMap(f"{prefix}ln_f.weight", ("final_norm.weight",)),
                 TensorMap(f"{prefix}ln_f.bias", ("final_norm.bias",))]
        if not cfg.tie_word_embeddings:
            maps.append(TensorMap("lm_head.weight", ("output.weight",)))
        return maps

    def ignored(self, hf_name: str) -> bool:
        # causal-mask buffers stored by old checkpoints, and a tied head some files still carry
        return bool(re.search(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$", hf_name)) or hf_name == "lm_head.weight"
