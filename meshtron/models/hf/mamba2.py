"""Mamba-2 (`Mamba2ForCausalLM`): a stack of Mamba-2 sublayers, no attention, no MLP.

On disk (`backbone.` prefix):
    embeddings.weight                          -> embedding.weight
    layers.{i}.norm.weight                     -> layers.{i}.norm.weight
    layers.{i}.mixer.in_proj.{weight,bias}     -> layers.{i}.mixer.{z,x,b,c,dt}_proj.*  (fused along the outputs)
    layers.{i}.mixer.conv1d.{weight,bias}      -> layers.{i}.mixer.conv_{x,b,c}.*       (fused along the channels)
    layers.{i}.mixer.{A_log,D,dt_bias}         -> the same names
    layers.{i}.mixer.norm.weight, out_proj.*   -> the same names
    norm_f.weight                              -> final_norm.weight
plus an untied lm_head. `mixer_maps` is shared with the hybrid families (NemotronH).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from meshtron.config.schema import ModelConfig
from meshtron.models.hf.adapter import TensorMap, hf_require, require

# meshtron has no positional limit for a pure Mamba stack; this is what the engine and data default to
DEFAULT_MAX_POSITIONS = 8192
INFINITY = {"__float__": "Infinity"}  # how transformers writes float('inf') into config.json


def read_float(value: Any) -> float:
    """A config.json number, including transformers' {'__float__': 'Infinity'} spelling."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def write_float(value: float) -> Any:
    return INFINITY if math.isinf(value) and value > 0 else value


def mixer_maps(cfg: ModelConfig, hf_prefix: str, ours: str) -> list[TensorMap]:
    """One Mamba-2 mixer: `hf_prefix` like 'backbone.layers.3.mixer', `ours` like 'layers.3.mixer'."""
    projections = tuple(f"{ours}.{p}_proj" for p in ("z", "x", "b", "c", "dt"))
    convs = tuple(f"{ours}.conv_{p}" for p in ("x", "b", "c"))
    maps = [TensorMap(f"{hf_prefix}.in_proj.weight", tuple(f"{p}.weight" for p in projections)),
            TensorMap(f"{hf_prefix}.conv1d.weight", tuple(f"{c}.weight" for c in convs))]
    if cfg.mamba_proj_bias:
        maps.append(TensorMap(f"{hf_prefix}.in_proj.bias", tuple(f"{p}.bias" for p in projections)))
    if cfg.mamba_conv_bias:
        maps.append(TensorMap(f"{hf_prefix}.conv1d.bias", tuple(f"{c}.bias" for c in convs)))
    for name in ("A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"):
        maps.append(TensorMap(f"{hf_prefix}.{name}", (f"{ours}.{name}",)))
    if cfg.mamba_proj_bias:
        maps.append(TensorMap(f"{hf_prefix}.out_proj.bias", (f"{ours}.out_proj.bias",)))
    return maps


def read_mixer_fields(hf: dict[str, Any], heads: int, head_dim: int, family: str) -> dict[str, Any]:
    """The mamba_* ModelConfig fields shared by Mamba-2 and the hybrids (their names in config.json agree)."""
    for key in ("hidden_act", "mamba_hidden_act"):
        if key in hf:
            hf_require(hf[key] == "silu", key, hf[key], family, "Mamba-2 mixers use silu")
    return dict(mamba_num_heads=heads, mamba_head_dim=head_dim, mamba_num_groups=hf["n_groups"],
                mamba_state_dim=hf.get("state_size", hf.get("ssm_state_size")), mamba_conv_kernel=hf["conv_kernel"],
                mamba_conv_bias=bool(hf.get("use_conv_bias", True)), mamba_chunk_size=hf["chunk_size"],
                mamba_dt_min=float(hf["time_step_min"]), mamba_dt_max=float(hf["time_step_max"]),
                mamba_dt_init_floor=float(hf["time_step_floor"]))


def write_mixer_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {"n_groups": cfg.mamba_num_groups, "conv_kernel": cfg.mamba_conv_kernel, "use_conv_bias": cfg.mamba_conv_bias,
            "chunk_size": cfg.mamba_chunk_size, "time_step_min": cfg.mamba_dt_min, "time_step_max": cfg.mamba_dt_max,
            "time_step_floor": cfg.mamba_dt_init_floor}


def require_expand(cfg: ModelConfig, target: str) -> int:
    """HF derives the inner width as expand * hidden_size: the meshtron one must be a whole multiple."""
    expand, rest = divmod(cfg.mamba_inner_size, cfg.hidden_size)
    require(rest == 0 and expand >= 1, "mamba_num_heads", cfg.mamba_num_heads, target,
            f"heads x head_dim = {cfg.mamba_inner_size} must be a multiple of hidden_size {cfg.hidden_size}")
    return expand


class Mamba2Adapter:
    name = "mamba2"
    architecture = "Mamba2ForCausalLM"

    def to_model_config(self, hf: dict[str, Any]) -> ModelConfig:
        lo, hi = (read_float(v) for v in hf.get("time_step_limit", (0.0, INFINITY)))
        heads, head_dim = hf["num_heads"], hf["head_dim"]
        hf_require(heads * head_dim == hf.get("expand", 2) * hf["hidden_size"], "num_heads", heads, self.name,
                   "num_heads * head_dim must equal expand * hidden_size")
        return ModelConfig(
            layer_pattern="M" * hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=1,
            vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=1,
            max_position_embeddings=int(hf.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)),
            position_embedding_type="none", normalization="RMSNorm", norm_epsilon=float(hf["layer_norm_epsilon"]),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            mamba_proj_bias=bool(hf.get("use_bias", False)), mamba_dt_limit_min=lo, mamba_dt_limit_max=hi,
            **read_mixer_fields(hf, heads, head_dim, self.name))

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        target = self.architecture
        n = len(cfg.pattern)
        require(cfg.pattern == "M" * n, "layer_pattern", cfg.pattern, target, "it is Mamba sublayers only ('M' * n)")
        require(cfg.normalization == "RMSNorm", "normalization", cfg.normalization, target, "it uses RMSNorm")
        require(cfg.position_embedding_type == "none", "position_embedding_type", cfg.position_embedding_type, target,
                "it has no position embeddings")
        return {
            "architectures": [self.architecture], "model_type": self.name, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_hidden_layers": n, "num_heads": cfg.mamba_heads,
            "head_dim": cfg.mamba_head_dim, "expand": require_expand(cfg, target), "state_size": cfg.mamba_state_dim,
            "layer_norm_epsilon": cfg.norm_epsilon, "use_bias": cfg.mamba_proj_bias, "hidden_act": "silu",
            "time_step_limit": [cfg.mamba_dt_limit_min, write_float(cfg.mamba_dt_limit_max)],
            "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
            **write_mixer_fields(cfg),
        }

    def tensor_maps(self, cfg: ModelConfig, hf_keys: Optional[set[str]] = None) -> list[TensorMap]:
        maps = [TensorMap("backbone.embeddings.weight", ("embedding.weight",))]
        for i in range(len(cfg.pattern)):
            maps.append(TensorMap(f"backbone.layers.{i}.norm.weight", (f"layers.{i}.norm.weight",)))
            maps += mixer_maps(cfg, f"backbone.layers.{i}.mixer", f"layers.{i}.mixer")
        maps.append(TensorMap("backbone.norm_f.weight", ("final_norm.weight",)))
        if not cfg.tie_word_embeddings:
            maps.append(TensorMap("lm_head.weight", ("output.weight",)))
        return maps

    def ignored(self, hf_name: str) -> bool:
        return hf_name == "lm_head.weight"  # a tied head some files still carry
