"""Residual sublayers: x = x + dropout(f(norm(x), ctx)) for one symbol of the layer pattern, and
`SUBLAYERS`, the registry of what each symbol of config.hybrid.LAYER_SYMBOLS means: the builder of its
mixer f ('*' attention: GQA or multi-latent; '-' MLP; 'M' Mamba-2; 'E' mixture of experts) and the
closed forms of its size (models/accounting.py). Its tensor-parallel plan is parallel/'s, keyed alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from meshtron.config.schema import ModelConfig
from meshtron.models import accounting
from meshtron.nn.attention import Attention
from meshtron.nn.context import MixerContext
from meshtron.nn.mamba import Mamba2Mixer
from meshtron.nn.mla import MultiLatentAttention
from meshtron.nn.mlp import MLP
from meshtron.nn.moe import MoELayer
from meshtron.nn.norm import build_norm
from meshtron.nn.rope_scaling import attention_softmax_scale


def build_attention(cfg: ModelConfig, layer_id: int, window_size: Optional[int]) -> nn.Module:
    """`layer_id` keys the KV cache; `window_size` is this layer's window (None: full attention)."""
    common = dict(layer_id=layer_id, qkv_bias=cfg.add_qkv_bias, out_bias=cfg.attention_output_bias,
                  dropout=cfg.attention_dropout, softmax_type=cfg.softmax_type, window_size=window_size,
                  rotary_interleaved=cfg.rotary_interleaved, norm_eps=cfg.norm_epsilon,
                  attention_backend=cfg.attention_backend)
    if cfg.multi_latent_attention:
        scale = attention_softmax_scale(cfg, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)
        return MultiLatentAttention(
            cfg.hidden_size, cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
            norm=cfg.normalization, softmax_scale=scale, **common)
    return Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim,
                     qk_norm=cfg.normalization if cfg.qk_layernorm else None,
                     softmax_scale=attention_softmax_scale(cfg, cfg.head_dim), **common)


def build_mlp(cfg: ModelConfig, layer_id: int = 0, window_size: Optional[int] = None) -> nn.Module:
    """An MLP keeps no cache and has no window: `layer_id` and `window_size` are unused."""
    return MLP(cfg.hidden_size, cfg.ffn_size, cfg.activation, bias=cfg.add_bias_linear,
               clamp_value=cfg.activation_func_clamp_value, linear_offset=cfg.glu_linear_offset)


def build_mamba(cfg: ModelConfig, layer_id: int, window_size: Optional[int] = None) -> nn.Module:
    """`layer_id` keys the layer's conv and SSM state at inference time (no window)."""
    return Mamba2Mixer(
        cfg.hidden_size, cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim,
        layer_id=layer_id, conv_kernel=cfg.mamba_conv_kernel, conv_bias=cfg.mamba_conv_bias,
        proj_bias=cfg.mamba_proj_bias, chunk_size=cfg.mamba_chunk_size, dt_min=cfg.mamba_dt_min,
        dt_max=cfg.mamba_dt_max, dt_init_floor=cfg.mamba_dt_init_floor,
        dt_limit=(cfg.mamba_dt_limit_min, cfg.mamba_dt_limit_max), norm_eps=cfg.norm_epsilon,
        recompute_scan=cfg.mamba_recompute_scan)


def build_moe(cfg: ModelConfig, layer_id: int = 0, window_size: Optional[int] = None) -> nn.Module:
    """Routed experts keep no cache and have no window: `layer_id` and `window_size` are unused."""
    return MoELayer(cfg)


@dataclass(frozen=True)
class SublayerKind:
    """What one pattern symbol means. `build(cfg, layer_id, window_size)` makes its mixer; `params(cfg)`
    counts the mixer's parameters and `matmul_params(cfg)` the matmul weights one token runs through
    (of a MoE mixer the router, shared and top-k experts): the memory and FLOP accounting. `name` is how
    messages call it; `selective_recompute`: `parallel.activation_checkpoint: selective` recomputes it."""
    build: Callable[[ModelConfig, int, Optional[int]], nn.Module]
    params: Callable[[ModelConfig], int]
    matmul_params: Callable[[ModelConfig], int]
    name: str = ""
    selective_recompute: bool = False


SUBLAYERS: dict[str, SublayerKind] = {
    "*": SublayerKind(build_attention, accounting.attention_params, accounting.attention_matmul_params, "attention",
                      selective_recompute=True),
    "-": SublayerKind(build_mlp, accounting.mlp_params, accounting.mlp_matmul_params, "MLP"),
    "M": SublayerKind(build_mamba, accounting.mamba_params, accounting.mamba_matmul_params, "Mamba-2",
                      selective_recompute=True),
    "E": SublayerKind(build_moe, accounting.moe_params, accounting.moe_active_matmul_params, "mixture of experts"),
}


class Sublayer(nn.Module):
    """Pre-norm residual wrapper around the mixer of one `SUBLAYERS` symbol."""

    def __init__(self, symbol: str, cfg: ModelConfig, layer_id: int, window_size: Optional[int] = None):
        super().__init__()
        if symbol not in SUBLAYERS:
            raise ValueError(f"model.layer_pattern: unknown symbol {symbol!r}; use one of {', '.join(map(repr, SUBLAYERS))}")
        self.symbol = symbol
        self.norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon)
        self.mixer: nn.Module = SUBLAYERS[symbol].build(cfg, layer_id, window_size)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, ctx: MixerContext) -> torch.Tensor:
        h = self.mixer(self.norm(x), ctx)
        # dropout is the identity in eval or at p = 0: skip its call (a decode step has 2 per layer)
        return x + (self.dropout(h) if self.training and self.dropout.p > 0 else h)


def build_sublayers(cfg: ModelConfig) -> nn.ModuleList:
    """One sublayer per pattern symbol; attention sublayers get their window from window_attn_skip_freq."""
    layers, attention_index = [], 0
    for layer_id, symbol in enumerate(cfg.pattern):
        window = None
        if symbol == "*":
            window = cfg.window_size if cfg.is_window_layer(attention_index) else None
            attention_index += 1
        layers.append(Sublayer(symbol, cfg, layer_id, window))
    return nn.ModuleList(layers)
