"""RoPE settings between config.json and `ModelConfig`.

config.json states RoPE in one of two spellings: transformers >= 5 writes
`rope_parameters: {rope_type, rope_theta, ...scaling keys}`; older files have a top-level
`rope_theta` and `rope_scaling: {type | rope_type, ...}` (or null). Both are read; `rope_parameters`
is written. Supported types: default, linear and llama3 (-> model.rope_scaling, with
rope_scaling_type linear or llama3) and yarn (-> position_embedding_type yarn). YaRN's cos/sin factor in transformers is
mscale(s, mscale) / mscale(s, mscale_all_dim) when both keys are non-zero, else mscale(s, 1): the
second case is meshtron's yarn_mscale=1, yarn_mscale_all_dim=0.
"""

from __future__ import annotations

import math
from typing import Any

from meshtron.config.schema import ModelConfig
from meshtron.models.hf.adapter import ConversionError, hf_require, require
from meshtron.nn.rope_scaling import yarn_get_mscale


def read_rope(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """ModelConfig fields for the RoPE of a config.json."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    hf_require(partial in (None, 1.0), "partial_rotary_factor", partial, family,
               "this family rotates whole heads; only 1.0 converts")
    fields: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": theta}
    if kind == "default":
        return fields
    if kind == "linear":
        return {**fields, "rope_scaling": True, "rope_scaling_type": "linear", "rope_scaling_factor": float(params["factor"])}
    if kind == "llama3":
        fields.update(rope_scaling=True, rope_scaling_type="llama3", rope_scaling_factor=float(params["factor"]),
                      rope_scaling_low_freq_factor=float(params["low_freq_factor"]),
                      rope_scaling_high_freq_factor=float(params["high_freq_factor"]),
                      rope_scaling_original_max_position_embeddings=int(params["original_max_position_embeddings"]))
        return fields
    if kind == "yarn":
        return {**fields, **_read_yarn(hf, params, family)}
    raise ConversionError(f"config.json rope type {kind!r} is not supported for {family}: "
                          "supported: default, linear, llama3, yarn")


def _read_yarn(hf: dict[str, Any], params: dict[str, Any], family: str) -> dict[str, Any]:
    original = int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    m, m_all = (float(mscale), float(mscale_all)) if mscale and mscale_all else (1.0, 0.0)
    explicit = params.get("attention_factor")
    derived = yarn_get_mscale(factor, m) / yarn_get_mscale(factor, m_all)
    hf_require(explicit is None or math.isclose(explicit, derived, rel_tol=0, abs_tol=1e-12),
               "rope_parameters.attention_factor", explicit, family,
               f"meshtron derives it from factor/mscale ({derived}); only that value converts")
    return {"position_embedding_type": "yarn", "yarn_rotary_scaling_factor": float(factor),
            "yarn_original_max_position_embeddings": original,
            "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
            "yarn_mscale": m, "yarn_mscale_all_dim": m_all,
            "correction_range_round_to_int": bool(params.get("truncate", True))}


def write_rope(cfg: ModelConfig, target: str) -> dict[str, Any]:
    """`rope_parameters` of a config.json for `cfg` (rope or yarn, whole heads, rotate-half layout)."""
    require(cfg.position_embedding_type in ("rope", "yarn"), "position_embedding_type", cfg.position_embedding_type,
            target, "it uses rotary positions (rope or yarn)")
    require(cfg.rotary_percent == 1.0, "rotary_percent", cfg.rotary_percent, target, "it rotates whole heads")
    require(not cfg.rotary_interleaved, "rotary_interleaved", cfg.rotary_interleaved, target,
            "it rotates the two halves of a head")
    params: dict[str, Any] = {"rope_theta": cfg.rotary_base, "rope_type": "default"}
    if cfg.rope_scaling and cfg.rope_scaling_type == "linear":
        params.update(rope_type="linear", factor=cfg.rope_scaling_factor)
    elif cfg.rope_scaling:
        params.update(rope_type="llama3", factor=cfg.rope_scaling_factor,
                      low_freq_factor=cfg.rope_scaling_low_freq_factor,
                      high_freq_factor=cfg.rope_scaling_high_freq_factor,
                      original_max_position_embeddings=cfg.rope_scaling_original_max_position_embeddings)
    elif cfg.position_embedding_type == "yarn":
        params.update(rope_type="yarn", factor=cfg.yarn_rotary_scaling_factor,
                      original_max_position_embeddings=cfg.yarn_original_max_position_embeddings,
                      beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow,
                      truncate=cfg.correction_range_round_to_int)
        if cfg.yarn_mscale_all_dim != 0:
            require(cfg.yarn_mscale != 0, "yarn_mscale", cfg.yarn_mscale, target,
                    "transformers ignores mscale_all_dim unless mscale is non-zero")
            params.update(mscale=cfg.yarn_mscale, mscale_all_dim=cfg.yarn_mscale_all_dim)
        else:
            require(cfg.yarn_mscale == 1.0, "yarn_mscale", cfg.yarn_mscale, target,
                    "without yarn_mscale_all_dim transformers uses mscale 1")
    return params
