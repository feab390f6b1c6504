"""NemotronH (`NemotronHForCausalLM`): a hybrid of Mamba-2, attention and squared-ReLU MLP sublayers.

config.json lists one block per sublayer (`layers_block_type`: linear_attention / full_attention /
mlp, or the older `hybrid_override_pattern` string 'M', '*', '-'), which is meshtron's layer pattern
symbol for symbol. Every block is pre-norm residual with one RMSNorm; attention has no position
embedding and no biases; the Mamba mixer clamps dt to [time_step_min, inf) and uses `use_bias` for
its projections. Biases of attention and MLP are not converted (meshtron ties the attention-output
bias to the MLP biases; NemotronH releases have none). On disk (`backbone.` as save_pretrained writes it, or `model.`):
    embeddings.weight                          -> embedding.weight
    layers.{i}.norm.weight                     -> layers.{i}.norm.weight
    layers.{i}.mixer.{in_proj,conv1d,...}      -> Mamba-2 mixer (see mamba2.py)
    layers.{i}.mixer.{q,k,v,o}_proj.weight     -> layers.{i}.mixer.{wq,wk,wv,wo}.weight
    layers.{i}.mixer.{up,down}_proj.weight     -> layers.{i}.mixer.{w_up,w_down}.weight
    norm_f.weight                              -> final_norm.weight
plus an untied lm_head.
"""

from __future__ import annotations

from typing import Any, Optional

from meshtron.config.schema import ModelConfig
from meshtron.models.hf.adapter import TensorMap, hf_require, require
from meshtron.models.hf.mamba2 import INFINITY, mixer_maps, read_mixer_fields, write_mixer_fields

BLOCK_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-"}
SYMBOL_BLOCKS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
MLP_ACTIVATIONS = {"relu2": "squared_relu"}


class NemotronHAdapter:
    name = "nemotron_h"
    architecture = "NemotronHForCausalLM"

    def _pattern(self, hf: dict[str, Any]) -> str:
        blocks = hf.get("layers_block_type")
        if blocks is None:
            return str(hf["hybrid_override_pattern"])
        unknown = sorted({b for b in blocks if b not in BLOCK_SYMBOLS})
        hf_require(not unknown, "layers_block_type", unknown, self.name,
                   "meshtron converts linear_attention, full_attention and mlp blocks")
        return "".join(BLOCK_SYMBOLS[b] for b in blocks)

    def to_model_config(self, hf: dict[str, Any]) -> ModelConfig:
        pattern = self._pattern(hf)
        hf_require(set(pattern) <= set(SYMBOL_BLOCKS), "hybrid_override_pattern", pattern, self.name,
                   "meshtron converts 'M' (Mamba), '*' (attention) and '-' (MLP) blocks")
        act = hf.get("mlp_hidden_act", "relu2")
        hf_require(act in MLP_ACTIVATIONS, "mlp_hidden_act", act, self.name, f"use one of {sorted(MLP_ACTIVATIONS)}")
        hf_require(hf.get("sliding_window") is None, "sliding_window", hf.get("sliding_window"), self.name,
                   "NemotronH attention is full attention")
        hf_require(not hf.get("mlp_bias", False) and not hf.get("attention_bias", False), "mlp_bias",
                   hf.get("mlp_bias"), self.name, "meshtron converts NemotronH without MLP or attention biases")
        hf_require(int(hf.get("num_nextn_predict_layers", 0)) == 0, "num_nextn_predict_layers",
                   hf.get("num_nextn_predict_layers"), self.name, "multi-token prediction layers are not converted")
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or d // heads
        return ModelConfig(
            layer_pattern=pattern, hidden_size=d, num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,
            kv_channels=None if head_dim * heads == d else head_dim, ffn_hidden_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=1,
            max_position_embeddings=hf["max_position_embeddings"], position_embedding_type="none",
            normalization="RMSNorm", norm_epsilon=float(hf["layer_norm_epsilon"]), activation=MLP_ACTIVATIONS[act],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_dropout=float(hf.get("attention_dropout", 0.0)), hidden_dropout=float(hf.get("hidden_dropout", 0.0)),
            mamba_proj_bias=bool(hf.get("use_bias", False)),
            # the mixer clamps dt to [time_step_min, inf), whatever config.json's time_step_limit says
            mamba_dt_limit_min=float(hf["time_step_min"]), mamba_dt_limit_max=float("inf"),
            **read_mixer_fields(hf, hf["mamba_num_heads"], hf["mamba_head_dim"], self.name))

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        target = self.architecture
        pattern = cfg.pattern
        require(set(pattern) <= set(SYMBOL_BLOCKS), "layer_pattern", pattern, target,
                "its blocks are 'M' (Mamba), '*' (attention) and '-' (MLP)")
        require(cfg.normalization == "RMSNorm", "normalization", cfg.normalization, target, "it uses RMSNorm")
        require(cfg.position_embedding_type == "none", "position_embedding_type", cfg.position_embedding_type, target,
                "its attention has no position embedding")
        require(cfg.activation == "squared_relu", "activation", cfg.activation, target, "its MLP uses relu2")
        require(not cfg.add_qkv_bias and not cfg.add_bias_linear and not cfg.multi_latent_attention
                and not cfg.qk_layernorm, "add_bias_linear", cfg.add_bias_linear, target,
                "its attention and MLP have no biases and no QK-norm")
        require(cfg.softmax_type == "vanilla" and cfg.window_size is None and cfg.softmax_scale in
                (None, cfg.head_dim ** -0.5), "softmax_type", cfg.softmax_type, target,
                "its attention is full, without sinks, scaled by 1/sqrt(head_dim)")
        require(cfg.mamba_dt_limit_max == float("inf") and cfg.mamba_dt_limit_min == cfg.mamba_dt_min,
                "mamba_dt_limit_min", cfg.mamba_dt_limit_min, target,
                "its mixer clamps dt to [time_step_min, inf): set mamba_dt_limit_min = mamba_dt_min, max inf")
        return {
            "architectures": [self.architecture], "model_type": self.name, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "layers_block_type": [SYMBOL_BLOCKS[s] for s in pattern],
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "attention_bias": False, "intermediate_size": cfg.ffn_size,
            "mlp_hidden_act": "relu2", "mlp_bias": False, "max_position_embeddings":
            cfg.max_position_embeddings, "layer_norm_epsilon": cfg.norm_epsilon,
            "mamba_num_heads": cfg.mamba_heads, "mamba_head_dim": cfg.mamba_head_dim, "ssm_state_size":
            cfg.mamba_state_dim, "mamba_hidden_act": "silu", "use_bias": cfg.mamba_proj_bias,
            "time_step_limit": [0.0, INFINITY], "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_dropout": cfg.attention_dropout, "hidden_dropout": cfg.hidden_dropout,
            "num_nextn_predict_layers": 0, **write_mixer_fields(cfg),
        }

    def tensor_maps(self, cfg: ModelConfig, hf_keys: Optional[set[str]] = None) -> list[TensorMap]:
        prefix = "model" if hf_keys is not None and "model.embeddings.weight" in hf_keys else "backbone"
        maps = [TensorMap(f"{prefix}.embeddings.weight", ("embedding.weight",))]
        for i, symbol in enumerate(cfg.pattern):
            hf, ours = f"{prefix}.layers.{i}", f"layers.{i}"
            maps.append(TensorMap(f"{hf}.norm.weight", (f"{ours}.norm.weight",)))
            if symbol == "M":
                maps += mixer_maps(cfg, f"{hf}.mixer", f"{ours}.mixer")
            elif symbol == "*":
                maps += [TensorMap(f"{hf}.mixer.{p}_proj.weight", (f"{ours}.mixer.w{p}.weight",)) for p in "qkvo"]
            else:
                maps += [TensorMap(f"{hf}.mixer.{hf_proj}.weight", (f"{ours}.mixer.{proj}.weight",))
                         for hf_proj, proj in (("up_proj", "w_up"), ("down_proj", "w_down"))]
        maps.append(TensorMap(f"{prefix}.norm_f.weight", ("final_norm.weight",)))
        if not cfg.tie_word_embeddings:
            maps.append(TensorMap("lm_head.weight", ("output.weight",)))
        return maps

    def ignored(self, hf_name: str) -> bool:
        return hf_name == "lm_head.weight"  # a tied head some files still carry
