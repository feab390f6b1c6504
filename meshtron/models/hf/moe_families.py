"""Mixture-of-experts families: Mixtral, Qwen3-MoE, DeepSeek-V3 and GPT-OSS.

Each decoder layer is attention then a feed-forward block, i.e. meshtron's '*' and then 'E' (MoE) or
'-' (dense). transformers fuses the experts in memory, but what `save_pretrained` writes (and what
released checkpoints hold) differs by family; these are the on-disk names:
    Mixtral     block_sparse_moe.gate.weight, block_sparse_moe.experts.{j}.{w1,w3,w2}.weight (gate, up, down)
    Qwen3-MoE   mlp.gate.weight, mlp.experts.{j}.{gate,up,down}_proj.weight; dense layers mlp.*_proj
                (mlp_only_layers, decoder_sparse_step)
    DeepSeek-V3 mlp.gate.weight, mlp.gate.e_score_correction_bias (-> router.expert_bias),
                mlp.experts.{j}.*_proj.weight, mlp.shared_experts.*_proj.weight; the first
                first_k_dense_replace layers dense; multi-latent attention (self_attn.q_a_proj, ...)
    GPT-OSS     mlp.router.{weight,bias}, mlp.experts.gate_up_proj (E, hidden, 2 ffn) with gate and up
                columns alternating, gate_up_proj_bias, down_proj (E, ffn, hidden), down_proj_bias;
                attention biases and sinks (self_attn.sinks)
Per-expert files map to entries of meshtron's stacked expert tensors (TensorMap.index).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from meshtron.config.schema import ModelConfig
from meshtron.models.hf.adapter import TensorMap, hf_require, require
from meshtron.models.hf.llama import LlamaLikeAdapter
from meshtron.models.hf.rope_config import read_rope, write_rope

EXPERT_PARAMS = ("w_gate", "w_up", "w_down")


def layer_is_moe(cfg: ModelConfig, target: str) -> list[bool]:
    """Per decoder layer: MoE ('*E') or dense ('*-'); any other pattern cannot be written as `target`."""
    n = cfg.pattern.count("*")
    pairs = [cfg.pattern[2 * i:2 * i + 2] for i in range(n)]
    require(len(cfg.pattern) == 2 * n and all(p in ("*E", "*-") for p in pairs), "layer_pattern", cfg.pattern,
            target, "each layer is attention then MoE or MLP ('*E' / '*-')")
    return [p == "*E" for p in pairs]


def dense_view(cfg: ModelConfig, ffn_size: Optional[int] = None) -> ModelConfig:
    """`cfg` with every layer '*-': lets a dense adapter handle the attention half of a MoE model."""
    n = cfg.pattern.count("*")
    return dataclasses.replace(cfg, layer_pattern="*-" * n, num_layers=n, num_moe_experts=None, moe_layer_freq=1,
                               ffn_hidden_size=ffn_size or cfg.ffn_size)


def layer_freq(flags: list[bool]) -> int | list[int]:
    return 1 if all(flags) else [int(f) for f in flags]


def require_router(cfg: ModelConfig, target: str, **expected: Any) -> None:
    """The MoE fields `target` cannot express must have these values."""
    defaults = dict(moe_router_type="topk", moe_router_score_function="softmax", moe_router_pre_softmax=False,
                    moe_router_num_groups=None, moe_router_topk_scaling_factor=None, moe_router_add_bias=False,
                    moe_router_enable_expert_bias=False, moe_shared_expert_intermediate_size=None,
                    moe_shared_expert_gate=False)
    for name, value in {**defaults, **expected}.items():
        require(getattr(cfg, name) == value, name, getattr(cfg, name), target, f"it needs {value!r} there")


def per_expert_maps(hf_prefix: str, mixer: str, hf_names: tuple[str, str, str], num_experts: int) -> list[TensorMap]:
    """`{hf_prefix}.{j}.{name}.weight` -> entry j of `{mixer}.experts.w_*`, grouped by parameter."""
    return [TensorMap(f"{hf_prefix}.{j}.{theirs}.weight", (f"{mixer}.experts.{ours}",), index=j)
            for ours, theirs in zip(EXPERT_PARAMS, hf_names) for j in range(num_experts)]


def without_mixers(maps: list[TensorMap], mixers: list[str]) -> list[TensorMap]:
    return [m for m in maps if not any(p.startswith(f"{x}.") for p in m.parts for x in mixers)]


def moe_mixers(flags: list[bool]) -> list[str]:
    return [f"layers.{2 * i + 1}.mixer" for i, moe in enumerate(flags) if moe]


@dataclass(frozen=True)
class MixtralAdapter(LlamaLikeAdapter):
    """Mistral attention; every layer MoE with softmax top-k routing renormalised over the k picks."""

    def to_model_config(self, hf: dict[str, Any]) -> ModelConfig:
        cfg = super().to_model_config(hf)
        return dataclasses.replace(cfg, num_moe_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
                                   moe_ffn_hidden_size=hf["intermediate_size"])

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        flags = layer_is_moe(cfg, self.architecture)
        require(all(flags), "layer_pattern", cfg.pattern, self.architecture, "every Mixtral layer is MoE ('*E')")
        require_router(cfg, self.architecture)
        hf = super().to_hf_config(dense_view(cfg, cfg.moe_ffn_size))
        hf.update(num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                  router_jitter_noise=0.0)
        return hf

    def tensor_maps(self, cfg: ModelConfig, hf_keys: Optional[set[str]] = None) -> list[TensorMap]:
        flags = [True] * cfg.pattern.count("*")
        maps = without_mixers(super().tensor_maps(dense_view(cfg)), moe_mixers(flags))
        for i, mixer in enumerate(moe_mixers(flags)):
            p = f"model.layers.{i}.block_sparse_moe"
            maps.append(TensorMap(f"{p}.gate.weight", (f"{mixer}.router.weight",)))
            maps += per_expert_maps(f"{p}.experts", mixer, ("w1", "w3", "w2"), cfg.num_moe_experts)
        return maps


@dataclass(frozen=True)
class Qwen3MoeAdapter(LlamaLikeAdapter):
    """Qwen3 attention (QK-norm); MoE layers chosen by decoder_sparse_step and mlp_only_layers;
    norm_topk_prob true is top-k before softmax (weights sum to 1), false top-k of the full softmax."""

    def to_model_config(self, hf: dict[str, Any]) -> ModelConfig:
        cfg = super().to_model_config(hf)
        experts = hf.get("num_experts", hf.get("num_local_experts", 0))
        n, step, dense = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        flags = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)]
        if not any(flags):
            return cfg
        return dataclasses.replace(cfg, num_moe_experts=experts, moe_router_topk=hf["num_experts_per_tok"],
                                   moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_layer_freq=layer_freq(flags),
                                   moe_router_pre_softmax=not hf.get("norm_topk_prob", False))

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        flags = layer_is_moe(cfg, self.architecture)
        require_router(cfg, self.architecture, moe_router_pre_softmax=cfg.moe_router_pre_softmax)
        hf = super().to_hf_config(dense_view(cfg))
        hf.update(num_experts=cfg.num_moe_experts or 0, num_experts_per_tok=cfg.moe_router_topk,
                  moe_intermediate_size=cfg.moe_ffn_size, decoder_sparse_step=1,
                  mlp_only_layers=[i for i, moe in enumerate(flags) if not moe],
                  norm_topk_prob=not cfg.moe_router_pre_softmax)
        return hf

    def tensor_maps(self, cfg: ModelConfig, hf_keys: Optional[set[str]] = None) -> list[TensorMap]:
        flags = [cfg.pattern[2 * i + 1] == "E" for i in range(cfg.pattern.count("*"))]
        maps = without_mixers(super().tensor_maps(dense_view(cfg)), moe_mixers(flags))
        for i, moe in enumerate(flags):
            if moe:
                mixer, p = f"layers.{2 * i + 1}.mixer", f"model.layers.{i}.mlp"
                maps.append(TensorMap(f"{p}.gate.weight", (f"{mixer}.router.weight",)))
                maps += per_expert_maps(f"{p}.experts", mixer, ("gate_proj", "up_proj", "down_proj"),
                                        cfg.num_moe_experts)
        return maps


@dataclass(frozen=True)
class GptOssAdapter(LlamaLikeAdapter):
    """Attention with biases and learned sinks, alternating sliding-window and full layers (layer_types),
    YaRN; every layer MoE: router with a bias, top-k of the logits then softmax, experts with biases and
    the clamped GLU (up + 1) * gate * sigmoid(1.702 gate) (meshtron's quick_geglu, clamp, offset 1)."""

    def _read_biases(self, hf: dict[str, Any]) -> dict[str, Any]:
        # the experts always have biases; attention_bias is q/k/v and the output's
        attn = bool(hf.get("attention_bias", True))
        return {"add_qkv_bias": attn, "add_bias_linear": True, "add_bias_attention_output": None if attn else False}

    def _read_window(self, hf: dict[str, Any]) -> dict[str, Any]:
        types = hf.get("layer_types") or []
        flags = [1 if t == "sliding_attention" else 0 for t in types]
        if not hf.get("sliding_window") or not any(flags):
            return {}
        return {"window_size": int(hf["sliding_window"]), "window_attn_skip_freq": None if all(flags) else flags}

    def _write_biases(self, cfg: ModelConfig, target: str) -> dict[str, Any]:
        require(cfg.add_bias_linear, "add_bias_linear", cfg.add_bias_linear, target, "GPT-OSS experts have biases")
        require(cfg.add_qkv_bias == cfg.attention_output_bias, "add_bias_attention_output",
                cfg.add_bias_attention_output, target,
                f"attention_bias covers q/k/v and the output together; set it to add_qkv_bias={cfg.add_qkv_bias}")
        return {"attention_bias": cfg.add_qkv_bias}

    def _write_window(self, cfg: ModelConfig, target: str, n: int) -> dict[str, Any]:
        flags = [cfg.is_window_layer(i) for i in range(n)]
        return {"sliding_window": cfg.window_size if any(flags) else None,
                "layer_types": ["sliding_attention" if f else "full_attention" for f in flags]}

    def to_model_config(self, hf: dict[str, Any]) -> ModelConfig:
        alpha = hf.get("swiglu_alpha", 1.702)
        hf_require(abs(alpha - 1.702) < 1e-12, "swiglu_alpha", alpha, self.name, "meshtron's quick-GeGLU uses 1.702")
        cfg = super().to_model_config(hf)
        return dataclasses.replace(
            cfg, activation="quick_geglu", activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
            glu_linear_offset=1.0, softmax_type="learnable", num_moe_experts=hf["num_local_experts"],
            moe_router_topk=hf["num_experts_per_tok"], moe_ffn_hidden_size=hf["intermediate_size"],
            moe_router_add_bias=True)

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        target = self.architecture
        flags = layer_is_moe(cfg, target)
        require(all(flags), "layer_pattern", cfg.pattern, target, "every GPT-OSS layer is MoE ('*E')")
        require_router(cfg, target, moe_router_add_bias=True)
        require(cfg.activation == "quick_geglu" and cfg.glu_linear_offset == 1.0
                and cfg.activation_func_clamp_value is not None, "activation", cfg.activation, target,
                "GPT-OSS experts are quick_geglu with a clamp and glu_linear_offset 1")
        require(cfg.softmax_type == "learnable", "softmax_type", cfg.softmax_type, target, "GPT-OSS learns sinks")
        plain = dataclasses.replace(dense_view(cfg, cfg.moe_ffn_size), activation="swiglu",
                                    activation_func_clamp_value=None, glu_linear_offset=0.0, softmax_type="vanilla")
        hf = super().to_hf_config(plain)
        hf.update(num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                  swiglu_limit=cfg.activation_func_clamp_value, swiglu_alpha=1.702)
        return hf

    def tensor_maps(self, cfg: ModelConfig, hf_keys: Optional[set[str]] = None) -> list[TensorMap]:
        n = cfg.pattern.count("*")
        mixers = moe_mixers([True] * n)
        maps = without_mixers(super().tensor_maps(dense_view(cfg)), mixers)
        for i, mixer in enumerate(mixers):
            p = f"model.layers.{i}"
            maps.append(TensorMap(f"{p}.self_attn.sinks", (f"layers.{2 * i}.mixer.sinks",)))
            maps += [TensorMap(f"{p}.mlp.router.weight", (f"{mixer}.router.weight",)),
                     TensorMap(f"{p}.mlp.router.bias", (f"{mixer}.router.bias",)),
                     TensorMap(f"{p}.mlp.experts.gate_up_proj", (f"{mixer}.experts.w_gate", f"{mixer}.experts.w_up"),
                               dim=1, transpose=True, interleave=True),
                     TensorMap(f"{p}.mlp.experts.gate_up_proj_bias",
                               (f"{mixer}.experts.b_gate", f"{mixer}.experts.b_up"), dim=1, interleave=True),
                     TensorMap(f"{p}.mlp.experts.down_proj", (f"{mixer}.experts.w_down",), transpose=True),
                     TensorMap(f"{p}.mlp.experts.down_proj_bias", (f"{mixer}.experts.b_down",))]
        return maps


MLA_NAMES = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
             "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo"}


class DeepseekV3Adapter:
    """Multi-latent attention; the first first_k_dense_replace layers dense, the rest MoE with shared
    experts and sigmoid routing: group-limited (n_group, topk_group, a group scoring its best two experts),
    an expert bias that only steers the choice (e_score_correction_bias), weights normalised and scaled
    by routed_scaling_factor. Multi-token-prediction layers are not part of the transformers model."""

    name = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"

    def to_model_config(self, hf: dict[str, Any]) -> ModelConfig:
        fam = self.name
        hf_require(hf.get("hidden_act", "silu") == "silu", "hidden_act", hf.get("hidden_act"), fam, "use silu")
        hf_require(not hf.get("attention_bias", False), "attention_bias", True, fam, "meshtron converts it without")
        hf_require(hf.get("num_key_value_heads", hf["num_attention_heads"]) == hf["num_attention_heads"],
                   "num_key_value_heads", hf.get("num_key_value_heads"), fam, "MLA has one key/value head per head")
        k, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
        hf_require(hf.get("norm_topk_prob", True) or k == 1, "norm_topk_prob", False, fam,
                   "meshtron normalises sigmoid top-k weights")
        hf_require(groups == 1 or k // group_topk == 2, "num_experts_per_tok", k, fam,
                   "a group scores its best two experts, which meshtron expresses as num_experts_per_tok / topk_group = 2")
        n, first_dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0)
        shared = hf.get("n_shared_experts") or 0
        rope = read_rope(hf, fam)
        return ModelConfig(
            num_layers=n, hidden_size=hf["hidden_size"], num_attention_heads=hf["num_attention_heads"],
            ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=1,
            max_position_embeddings=hf["max_position_embeddings"], normalization="RMSNorm",
            norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_dropout=float(hf.get("attention_dropout", 0.0)), multi_latent_attention=True,
            q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
            qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
            rotary_interleaved=bool(hf.get("rope_interleave", True)), **rope,
            num_moe_experts=hf["n_routed_experts"], moe_router_topk=k, moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_layer_freq=layer_freq([i >= first_dense for i in range(n)]),
            moe_shared_expert_intermediate_size=shared * hf["moe_intermediate_size"] or None,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=group_topk if groups > 1 else None,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        target = self.architecture
        flags = layer_is_moe(cfg, target)
        require(cfg.multi_latent_attention, "multi_latent_attention", False, target, "DeepSeek-V3 uses MLA")
        first_dense = flags.index(True) if any(flags) else len(flags)
        require(all(flags[first_dense:]), "layer_pattern", cfg.pattern, target, "dense layers come first, then MoE")
        shared = cfg.moe_shared_expert_intermediate_size or 0
        require(shared % cfg.moe_ffn_size == 0, "moe_shared_expert_intermediate_size", shared, target,
                "it is n_shared_experts * moe_ffn_hidden_size")
        groups = cfg.moe_router_num_groups
        require_router(cfg, target, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_num_groups=groups, moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
                       moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size)
        require(groups is None or cfg.moe_router_topk // cfg.moe_router_group_topk == 2, "moe_router_group_topk",
                cfg.moe_router_group_topk, target, "a DeepSeek group scores its best two experts (topk / group_topk = 2)")
        require(cfg.normalization == "RMSNorm" and cfg.activation == "swiglu", "activation", cfg.activation, target,
                "it uses RMSNorm and SwiGLU")
        require(not cfg.add_qkv_bias and not cfg.add_bias_linear and not cfg.attention_output_bias
                and cfg.softmax_type == "vanilla" and cfg.window_size is None, "add_bias_linear", cfg.add_bias_linear, target,
                "it has no biases, sinks or sliding windows")
        return {
            "architectures": [self.architecture], "model_type": self.name, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": len(flags),
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
            "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_head_dim,
            "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim,
            "rope_interleave": cfg.rotary_interleaved, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
            "rope_parameters": _write_rope_any_layout(cfg, target), "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": False, "attention_dropout": cfg.attention_dropout,
            "n_routed_experts": cfg.num_moe_experts, "num_experts_per_tok": cfg.moe_router_topk,
            "moe_intermediate_size": cfg.moe_ffn_size, "n_shared_experts": shared // cfg.moe_ffn_size,
            "first_k_dense_replace": first_dense, "n_group": groups or 1, "topk_group": cfg.moe_router_group_topk or 1,
            "norm_topk_prob": True, "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
            "num_nextn_predict_layers": 0,
        }

    def tensor_maps(self, cfg: ModelConfig, hf_keys: Optional[set[str]] = None) -> list[TensorMap]:
        maps = [TensorMap("model.embed_tokens.weight", ("embedding.weight",))]
        attention = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        attention += ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        for i in range(cfg.pattern.count("*")):
            a, m, p = f"layers.{2 * i}", f"layers.{2 * i + 1}", f"model.layers.{i}"
            maps.append(TensorMap(f"{p}.input_layernorm.weight", (f"{a}.norm.weight",)))
            maps += [TensorMap(f"{p}.self_attn.{name}.weight", (f"{a}.mixer.{MLA_NAMES[name]}.weight",))
                     for name in attention]
            maps.append(TensorMap(f"{p}.post_attention_layernorm.weight", (f"{m}.norm.weight",)))
            projections = ("gate_proj", "up_proj", "down_proj")
            if cfg.pattern[2 * i + 1] == "-":
                maps += [TensorMap(f"{p}.mlp.{theirs}.weight", (f"{m}.mixer.{ours}.weight",))
                         for ours, theirs in zip(EXPERT_PARAMS, projections)]
                continue
            maps += [TensorMap(f"{p}.mlp.gate.weight", (f"{m}.mixer.router.weight",)),
                     TensorMap(f"{p}.mlp.gate.e_score_correction_bias", (f"{m}.mixer.router.expert_bias",))]
            maps += per_expert_maps(f"{p}.mlp.experts", f"{m}.mixer", projections, cfg.num_moe_experts)
            if cfg.moe_shared_expert_intermediate_size:
                maps += [TensorMap(f"{p}.mlp.shared_experts.{theirs}.weight", (f"{m}.mixer.shared_experts.{ours}.weight",))
                         for ours, theirs in zip(EXPERT_PARAMS, projections)]
        maps.append(TensorMap("model.norm.weight", ("final_norm.weight",)))
        if not cfg.tie_word_embeddings:
            maps.append(TensorMap("lm_head.weight", ("output.weight",)))
        return maps

    def ignored(self, hf_name: str) -> bool:
        return hf_name.endswith("rotary_emb.inv_freq")


def _write_rope_any_layout(cfg: ModelConfig, target: str) -> dict[str, Any]:
    """rope_parameters for MLA, whose RoPE layout (interleaved or not) is rope_interleave's to say."""
    return write_rope(dataclasses.replace(cfg, rotary_interleaved=False), target)


MOE_FAMILIES = (
    MixtralAdapter("mixtral", "MixtralForCausalLM", bias_style="none", window_style="all"),
    Qwen3MoeAdapter("qwen3_moe", "Qwen3MoeForCausalLM", bias_style="qwen3", qk_norm=True, window_style="layer_types"),
    DeepseekV3Adapter(),
    GptOssAdapter("gpt_oss", "GptOssForCausalLM", bias_style="none", window_style="layer_types"),
)
