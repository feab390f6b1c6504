"""NemotronH (`NemotronHForCausalLM`): a hybrid of Mamba-2, attention, squared-ReLU MLP and MoE sublayers.

config.json lists one block per sublayer (`layers_block_type`: linear_attention / full_attention /
mlp / moe, or the older `hybrid_override_pattern` string 'M', '*', '-', 'E'), which is meshtron's
layer pattern symbol for symbol. An MoE block routes like DeepSeek-V3 (sigmoid scores, an expert
bias that only steers the choice, optional group-limited choice, normalised and scaled weights) to
non-gated relu2 experts, plus one always-on shared relu2 MLP. Every block is pre-norm residual with one RMSNorm; attention has no position
embedding and no biases; the Mamba mixer clamps dt to [time_step_min, inf) and uses `use_bias` for
its projections. Biases of attention and MLP are not converted (meshtron ties the attention-output
bias to the MLP biases; NemotronH releases have none). On disk (`backbone.` as save_pretrained writes it, or `model.`):
    embeddings.weight                          -> embedding.weight
    layers.{i}.norm.weight                     -> layers.{i}.norm.weight
    layers.{i}.mixer.{in_proj,conv1d,...}      -> Mamba-2 mixer (see mamba2.py)
    layers.{i}.mixer.{q,k,v,o}_proj.weight     -> layers.{i}.mixer.{wq,wk,wv,wo}.weight
    layers.{i}.mixer.{up,down}_proj.weight     -> layers.{i}.mixer.{w_up,w_down}.weight
    layers.{i}.mixer.gate.weight, gate.e_score_correction_bias -> layers.{i}.mixer.router.{weight,expert_bias}
    layers.{i}.mixer.experts.{j}.{up,down}_proj.weight         -> entry j of layers.{i}.mixer.experts.w_{up,down}
    layers.{i}.mixer.shared_experts.{up,down}_proj.weight      -> layers.{i}.mixer.shared_experts.w_{up,down}.weight
    norm_f.weight                              -> final_norm.weight
plus an untied lm_head.
"""

from __future__ import annotations

from typing import Any, Optional

from meshtron.config.schema import ModelConfig
from meshtron.models.hf.adapter import TensorMap, hf_require, require
from meshtron.models.hf.mamba2 import INFINITY, mixer_maps, read_mixer_fields, write_mixer_fields
from meshtron.models.hf.moe_families import require_router

BLOCK_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                 "moe": "E"}
SYMBOL_BLOCKS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
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
                   "meshtron converts linear_attention, full_attention, mlp and moe blocks")
        return "".join(BLOCK_SYMBOLS[b] for b in blocks)

    def to_model_config(self, hf: dict[str, Any]) -> ModelConfig:
        pattern = self._pattern(hf)
        hf_require(set(pattern) <= set(SYMBOL_BLOCKS), "hybrid_override_pattern", pattern, self.name,
                   "meshtron converts 'M' (Mamba), '*' (attention), '-' (MLP) and 'E' (MoE) blocks")
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
            **read_mixer_fields(hf, hf["mamba_num_heads"], hf["mamba_head_dim"], self.name),
            **(self._read_moe(hf) if "E" in pattern else {}))

    def _read_moe(self, hf: dict[str, Any]) -> dict[str, Any]:
        k, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
        hf_require(hf.get("moe_latent_size") is None, "moe_latent_size", hf.get("moe_latent_size"), self.name,
                   "meshtron converts experts that work at hidden_size (no latent projection)")
        hf_require(hf.get("norm_topk_prob", True) or k == 1, "norm_topk_prob", False, self.name,
                   "meshtron normalises sigmoid top-k weights")
        hf_require(groups == 1 or k // group_topk == 2, "num_experts_per_tok", k, self.name,
                   "a group scores its best two experts, which meshtron expresses as num_experts_per_tok / topk_group = 2")
        return dict(num_moe_experts=hf["n_routed_experts"], moe_router_topk=k,
                    moe_ffn_hidden_size=hf["moe_intermediate_size"],
                    moe_shared_expert_intermediate_size=hf["moe_shared_expert_intermediate_size"],
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_num_groups=groups if groups > 1 else None,
                    moe_router_group_topk=group_topk if groups > 1 else None,
                    moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        target = self.architecture
        pattern = cfg.pattern
        require(set(pattern) <= set(SYMBOL_BLOCKS), "layer_pattern", pattern, target,
                "its blocks are 'M' (Mamba), '*' (attention), '-' (MLP) and 'E' (MoE)")
        require(cfg.normalization == "RMSNorm", "normalization", cfg.normalization, target, "it uses RMSNorm")
        require(cfg.position_embedding_type == "none", "position_embedding_type", cfg.position_embedding_type, target,
                "its attention has no position embedding")
        require(cfg.activation == "squared_relu", "activation", cfg.activation, target, "its MLP uses relu2")
        require(not cfg.add_qkv_bias and not cfg.add_bias_linear and not cfg.attention_output_bias
                and not cfg.multi_latent_attention and not cfg.qk_layernorm, "add_bias_linear", cfg.add_bias_linear, target,
                "its attention and MLP have no biases and no QK-norm")
        require(cfg.softmax_type == "vanilla" and cfg.window_size is None and cfg.softmax_scale in
                (None, cfg.head_dim ** -0.5), "softmax_type", cfg.softmax_type, target,
                "its attention is full, without sinks, scaled by 1/sqrt(head_dim)")
        moe = self._write_moe(cfg, target) if "E" in pattern else {}
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
            "num_nextn_predict_layers": 0, **write_mixer_fields(cfg), **moe,
        }

    def _write_moe(self, cfg: ModelConfig, target: str) -> dict[str, Any]:
        groups = cfg.moe_router_num_groups
        require_router(cfg, target, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_num_groups=groups, moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
                       moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size)
        require(cfg.moe_shared_expert_intermediate_size is not None, "moe_shared_expert_intermediate_size", None,
                target, "every NemotronH MoE block has a shared expert")
        require(groups is None or cfg.moe_router_topk // cfg.moe_router_group_topk == 2, "moe_router_group_topk",
                cfg.moe_router_group_topk, target, "a group scores its best two experts (topk / group_topk = 2)")
        return {"n_routed_experts": cfg.num_moe_experts, "num_experts_per_tok": cfg.moe_router_topk,
                "moe_intermediate_size": cfg.moe_ffn_size, "n_shared_experts": 1,
                "moe_shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
                "moe_latent_size": None, "n_group": groups or 1, "topk_group": cfg.moe_router_group_topk or 1,
                "norm_topk_prob": True, "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0}

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
            elif symbol == "-":
                maps += [TensorMap(f"{hf}.mixer.{hf_proj}.weight", (f"{ours}.mixer.{proj}.weight",))
                         for hf_proj, proj in (("up_proj", "w_up"), ("down_proj", "w_down"))]
            else:
                maps += moe_maps(cfg, f"{hf}.mixer", f"{ours}.mixer")
        maps.append(TensorMap(f"{prefix}.norm_f.weight", ("final_norm.weight",)))
        if not cfg.tie_word_embeddings:
            maps.append(TensorMap("lm_head.weight", ("output.weight",)))
        return maps

    def ignored(self, hf_name: str) -> bool:
        return hf_name == "lm_head.weight"  # a tied head some files still carry


def moe_maps(cfg: ModelConfig, hf: str, ours: str) -> list[TensorMap]:
    """One MoE block: router, per-expert files into the stacked experts, the shared expert."""
    projections = (("up_proj", "w_up"), ("down_proj", "w_down"))
    maps = [TensorMap(f"{hf}.gate.weight", (f"{ours}.router.weight",)),
            TensorMap(f"{hf}.gate.e_score_correction_bias", (f"{ours}.router.expert_bias",))]
    maps += [TensorMap(f"{hf}.experts.{j}.{theirs}.weight", (f"{ours}.experts.{mine}",), index=j)
             for theirs, mine in projections for j in range(cfg.num_moe_experts)]
    maps += [TensorMap(f"{hf}.shared_experts.{theirs}.weight", (f"{ours}.shared_experts.{mine}.weight",))
             for theirs, mine in projections]
    return maps
