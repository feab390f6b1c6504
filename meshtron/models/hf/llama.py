"""Llama-style families: Llama, Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (QK-norm).

All four lay a decoder layer out on disk as
    model.layers.{i}.input_layernorm.weight            -> layers.{2i}.norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.*        -> layers.{2i}.mixer.{wq,wk,wv,wo}.*
    model.layers.{i}.self_attn.{q,k}_norm.weight       -> layers.{2i}.mixer.{q,k}_norm.weight   (Qwen3)
    model.layers.{i}.post_attention_layernorm.weight   -> layers.{2i+1}.norm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.*         -> layers.{2i+1}.mixer.{w_gate,w_up,w_down}.*
plus model.embed_tokens, model.norm and (untied) lm_head. They differ in which biases exist, in
QK-norm and in how sliding windows are declared (Mistral: every layer; Qwen: `layer_types`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from meshtron.config.schema import ModelConfig
from meshtron.models.hf.adapter import TensorMap, hf_require, require
from meshtron.models.hf.rope_config import read_rope, write_rope

GATED_ACTIVATIONS = {"silu": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh"}
ACTIVATION_NAMES = {v: k for k, v in GATED_ACTIVATIONS.items()}


@dataclass(frozen=True)
class LlamaLikeAdapter:
    name: str
    architecture: str
    bias_style: str               # "llama": attention_bias/mlp_bias; "qwen2": fixed q/k/v bias;
    #                               "qwen3": attention_bias (q/k/v and output), never an MLP bias; "none"
    qk_norm: bool = False
    window_style: Optional[str] = None  # "all" (Mistral), "layer_types" (Qwen) or None (no windows)

    # ---- config.json -> ModelConfig -----------------------------------------------------------

    def to_model_config(self, hf: dict[str, Any]) -> ModelConfig:
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or d // heads
        act = hf.get("hidden_act", "silu")
        hf_require(act in GATED_ACTIVATIONS, "hidden_act", act, self.name, f"use one of {sorted(GATED_ACTIVATIONS)}")
        fields: dict[str, Any] = dict(
            num_layers=hf["num_hidden_layers"], hidden_size=d, num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,
            kv_channels=None if head_dim * heads == d else head_dim,
            ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=1,
            max_position_embeddings=hf["max_position_embeddings"], normalization="RMSNorm",
            norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), activation=GATED_ACTIVATIONS[act],
            qk_layernorm=self.qk_norm, **self._read_biases(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            **read_rope(hf, self.name), **self._read_window(hf))
        return ModelConfig(**fields)

    def _read_biases(self, hf: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig bias fields; add_bias_attention_output is set only where it differs from the MLP's."""
        if self.bias_style == "qwen2":
            return {"add_qkv_bias": True}
        if self.bias_style == "none":
            return {}
        attn = bool(hf.get("attention_bias", False))
        mlp = bool(hf.get("mlp_bias", False)) if self.bias_style == "llama" else False
        return {"add_qkv_bias": attn, "add_bias_linear": mlp, "add_bias_attention_output": None if attn == mlp else attn}

    def _read_window(self, hf: dict[str, Any]) -> dict[str, Any]:
        if self.window_style == "all":
            window = hf.get("sliding_window")
            return {"window_size": int(window)} if window else {}
        if self.window_style != "layer_types":
            return {}
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        if window is None:
            return {}
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28)
                                          else "full_attention" for i in range(n)]
        flags = [1 if t == "sliding_attention" else 0 for t in types]
        if not any(flags):
            return {}
        return {"window_size": int(window), "window_attn_skip_freq": None if all(flags) else flags}

    # ---- ModelConfig -> config.json -----------------------------------------------------------

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        target = self.architecture
        n = cfg.pattern.count("*")
        require(cfg.pattern == "*-" * n, "layer_pattern", cfg.pattern, target, "it alternates attention and MLP ('*-' per layer)")
        require(not cfg.multi_latent_attention, "multi_latent_attention", True, target, "it uses grouped-query attention")
        require(cfg.normalization == "RMSNorm", "normalization", cfg.normalization, target, "it uses RMSNorm")
        require(cfg.activation in ACTIVATION_NAMES, "activation", cfg.activation, target,
                f"it uses a gated MLP: {', '.join(ACTIVATION_NAMES)}")
        require(cfg.activation_func_clamp_value is None and cfg.glu_linear_offset == 0.0, "activation_func_clamp_value",
                cfg.activation_func_clamp_value, target, "it has no MLP clamp or linear offset")
        require(cfg.softmax_type == "vanilla", "softmax_type", cfg.softmax_type, target, "it has no attention sinks")
        require(cfg.softmax_scale in (None, cfg.head_dim ** -0.5), "softmax_scale", cfg.softmax_scale, target,
                "it scales logits by 1/sqrt(head_dim)")
        require(cfg.qk_layernorm == self.qk_norm, "qk_layernorm", cfg.qk_layernorm, target,
                "QK-norm is Qwen3's" if self.qk_norm is False else "Qwen3 normalises queries and keys")
        hf: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.name, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": n,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "hidden_act": ACTIVATION_NAMES[cfg.activation],
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
            "rope_parameters": write_rope(cfg, target), "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_dropout": cfg.attention_dropout,
        }
        hf.update(self._write_biases(cfg, target))
        hf.update(self._write_window(cfg, target, n))
        return hf

    def _write_biases(self, cfg: ModelConfig, target: str) -> dict[str, Any]:
        out = cfg.attention_output_bias
        if self.bias_style == "qwen2":
            require(cfg.add_qkv_bias and not out and not cfg.add_bias_linear, "add_qkv_bias", cfg.add_qkv_bias, target,
                    "Qwen2 has q/k/v biases and no other (add_qkv_bias true, add_bias_linear and "
                    "add_bias_attention_output false)")
            return {}
        if self.bias_style == "none":
            require(not cfg.add_qkv_bias and not out and not cfg.add_bias_linear, "add_qkv_bias", cfg.add_qkv_bias,
                    target, "it has no biases")
            return {}
        require(cfg.add_qkv_bias == out, "add_bias_attention_output", cfg.add_bias_attention_output, target,
                f"attention_bias covers q/k/v and the output together; set it to add_qkv_bias={cfg.add_qkv_bias}")
        if self.bias_style == "llama":
            return {"attention_bias": cfg.add_qkv_bias, "mlp_bias": cfg.add_bias_linear}
        require(not cfg.add_bias_linear, "add_bias_linear", cfg.add_bias_linear, target,
                "its MLP has no biases (attention biases: add_qkv_bias and add_bias_attention_output)")
        return {"attention_bias": cfg.add_qkv_bias}

    def _write_window(self, cfg: ModelConfig, target: str, n: int) -> dict[str, Any]:
        flags = [cfg.is_window_layer(i) for i in range(n)]
        if self.window_style is None:
            require(cfg.window_size is None, "window_size", cfg.window_size, target,
                    "it has no sliding window (Mistral, Qwen2 and Qwen3 do)")
            return {}
        if self.window_style == "all":
            require(cfg.window_size is None or all(flags), "window_attn_skip_freq", cfg.window_attn_skip_freq, target,
                    "Mistral windows every layer")
            return {"sliding_window": cfg.window_size}
        first = flags.index(True) if any(flags) else n
        return {"use_sliding_window": any(flags), "sliding_window": cfg.window_size if any(flags) else None,
                "max_window_layers": first,
                "layer_types": ["sliding_attention" if f else "full_attention" for f in flags]}

    # ---- tensors ------------------------------------------------------------------------------

    def tensor_maps(self, cfg: ModelConfig, hf_keys: Optional[set[str]] = None) -> list[TensorMap]:
        maps = [TensorMap("model.embed_tokens.weight", ("embedding.weight",))]
        for i in range(cfg.pattern.count("*")):
            a, m = f"layers.{2 * i}", f"layers.{2 * i + 1}"
            p = f"model.layers.{i}"
            maps.append(TensorMap(f"{p}.input_layernorm.weight", (f"{a}.norm.weight",)))
            for hf_proj, ours, bias in (("q_proj", "wq", cfg.add_qkv_bias), ("k_proj", "wk", cfg.add_qkv_bias),
                                        ("v_proj", "wv", cfg.add_qkv_bias), ("o_proj", "wo", cfg.attention_output_bias)):
                maps.append(TensorMap(f"{p}.self_attn.{hf_proj}.weight", (f"{a}.mixer.{ours}.weight",)))
                if bias:
                    maps.append(TensorMap(f"{p}.self_attn.{hf_proj}.bias", (f"{a}.mixer.{ours}.bias",)))
            if cfg.qk_layernorm:
                maps.append(TensorMap(f"{p}.self_attn.q_norm.weight", (f"{a}.mixer.q_norm.weight",)))
                maps.append(TensorMap(f"{p}.self_attn.k_norm.weight", (f"{a}.mixer.k_norm.weight",)))
            maps.append(TensorMap(f"{p}.post_attention_layernorm.weight", (f"{m}.norm.weight",)))
            for hf_proj, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
                maps.append(TensorMap(f"{p}.mlp.{hf_proj}.weight", (f"{m}.mixer.{ours}.weight",)))
                if cfg.add_bias_linear:
                    maps.append(TensorMap(f"{p}.mlp.{hf_proj}.bias", (f"{m}.mixer.{ours}.bias",)))
        maps.append(TensorMap("model.norm.weight", ("final_norm.weight",)))
        if not cfg.tie_word_embeddings:
            maps.append(TensorMap("lm_head.weight", ("output.weight",)))
        return maps

    def ignored(self, hf_name: str) -> bool:
        # rotary buffers saved by old transformers versions, and a tied head some files still carry
        return bool(re.search(r"rotary_emb\.inv_freq$", hf_name)) or hf_name == "lm_head.weight"


LLAMA_LIKE = (
    LlamaLikeAdapter("llama", "LlamaForCausalLM", bias_style="llama"),
    LlamaLikeAdapter("mistral", "MistralForCausalLM", bias_style="none", window_style="all"),
    LlamaLikeAdapter("qwen2", "Qwen2ForCausalLM", bias_style="qwen2", window_style="layer_types"),
    LlamaLikeAdapter("qwen3", "Qwen3ForCausalLM", bias_style="qwen3", qk_norm=True, window_style="layer_types"),
)
