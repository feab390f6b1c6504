"""The decoder: token embedding, one residual sublayer per symbol of the layer pattern, final norm
and output head. Each sublayer computes x = x + dropout(f(norm(x), ctx)).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from meshtron.config.schema import ModelConfig
from meshtron.nn.attention import Attention
from meshtron.nn.context import PackedContext
from meshtron.nn.mlp import ACTIVATIONS, MLP
from meshtron.nn.norm import build_norm
from meshtron.nn.rotary import RotaryEmbedding


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    return int(math.ceil(vocab_size / divisible_by) * divisible_by)


class Sublayer(nn.Module):
    """Pre-norm residual wrapper around one mixer ('*' attention or '-' MLP)."""

    def __init__(self, symbol: str, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.symbol = symbol
        self.norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon)
        if symbol == "*":
            self.mixer: nn.Module = Attention(
                cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim, layer_id=layer_id,
                qkv_bias=cfg.add_qkv_bias, out_bias=cfg.add_bias_linear, dropout=cfg.attention_dropout,
            )
        elif symbol == "-":
            self.mixer = MLP(cfg.hidden_size, cfg.ffn_size, cfg.activation, bias=cfg.add_bias_linear)
        else:
            raise ValueError(f"model.layer_pattern: unknown symbol {symbol!r}")
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        return x + self.dropout(self.mixer(self.norm(x), ctx))


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: Optional[int] = None):
        super().__init__()
        self.cfg = cfg
        vocab = cfg.vocab_size or vocab_size
        if vocab is None:
            raise ValueError("model.vocab_size: null and no tokenizer size given; set model.vocab_size")
        self.vocab_size = padded_vocab_size(vocab, cfg.make_vocab_size_divisible_by)
        self.embedding = nn.Embedding(self.vocab_size, cfg.hidden_size)
        self.position_embedding = (
            nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            if cfg.position_embedding_type == "learned_absolute" else None
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rotary_base) if cfg.position_embedding_type == "rope" else None
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(Sublayer(s, cfg, i) for i, s in enumerate(cfg.pattern))
        self.final_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, self.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, std) weights; output projections scaled by 1/sqrt(2 * depth); zero biases; unit norms."""
        std = self.cfg.init_method_std
        out_std = std / math.sqrt(2.0 * self.cfg.num_transformer_layers) if self.cfg.scaled_init else std
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_output_proj = name.endswith(".wo") or name.endswith(".w_down")
                nn.init.normal_(module.weight, 0.0, out_std if is_output_proj else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)

    def forward(self, tokens: torch.Tensor, ctx=None) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab)."""
        if ctx is None:
            ctx = PackedContext.for_tokens(tokens)
        h = self.embedding(tokens)
        if self.position_embedding is not None:
            h = h + self.position_embedding(ctx.positions)
        if self.rotary is not None:
            ctx.rope = self.rotary(ctx.positions)
        h = self.embedding_dropout(h)
        for layer in self.layers:
            h = layer(h, ctx)
        h = self.final_norm(h)
        if self.output is None:
            return nn.functional.linear(h, self.embedding.weight)
        return self.output(h)


def count_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Closed-form parameter count of `GPTModel(cfg, vocab_size)` (vocab already padded or not)."""
    v = padded_vocab_size(cfg.vocab_size or vocab_size, cfg.make_vocab_size_divisible_by)
    d, hd = cfg.hidden_size, cfg.head_dim
    norm = d if cfg.normalization == "RMSNorm" else 2 * d
    attn = (d * cfg.num_attention_heads * hd + 2 * d * cfg.num_kv_heads * hd + cfg.num_attention_heads * hd * d)
    if cfg.add_qkv_bias:
        attn += (cfg.num_attention_heads + 2 * cfg.num_kv_heads) * hd
    if cfg.add_bias_linear:
        attn += d
    gated = ACTIVATIONS[cfg.activation][1]
    f = cfg.ffn_size
    mlp = (3 if gated else 2) * d * f
    if cfg.add_bias_linear:
        mlp += (2 if gated else 1) * f + d
    total = v * d + norm  # embedding + final norm
    if cfg.position_embedding_type == "learned_absolute":
        total += cfg.max_position_embeddings * d
    if not cfg.tie_word_embeddings:
        total += v * d
    for s in cfg.pattern:
        total += norm + (attn if s == "*" else mlp)
    return total


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), PaLM-style accounting.

    forward = 2 * P_matmul + sum over attention sublayers of 2 * 2 * seq * heads * head_dim
    where P_matmul counts every weight used in a matmul (sublayer projections and the output head,
    not the embedding lookup) and the second term is QK^T and AV without halving for causality.
    training = 3 * forward = 6 * P_matmul + 12 * n_attn * seq * heads * head_dim.
    """
    v = padded_vocab_size(cfg.vocab_size or vocab_size, cfg.make_vocab_size_divisible_by)
    d, hd, h, g = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_kv_heads
    attn_w = d * h * hd + 2 * d * g * hd + h * hd * d
    mlp_w = (3 if ACTIVATIONS[cfg.activation][1] else 2) * d * cfg.ffn_size
    matmul_params = v * d + sum(attn_w if s == "*" else mlp_w for s in cfg.pattern)
    n_attn = cfg.pattern.count("*")
    return 6.0 * matmul_params + 12.0 * n_attn * seq_length * h * hd
