"""The decoder: token embedding (plus learned positions or RoPE), one residual sublayer per symbol of
the layer pattern, final norm and output head; optionally multi-token-prediction depths.
Each sublayer computes x = x + dropout(f(norm(x), ctx)).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from meshtron.config.schema import ModelConfig
from meshtron.models.accounting import count_parameters, flops_per_token, padded_vocab_size
from meshtron.models.blocks import Sublayer, build_sublayers
from meshtron.models.mtp import MTPDepth, shift_left
from meshtron.nn.context import PackedContext
from meshtron.nn.norm import build_norm
from meshtron.nn.rope_scaling import build_rotary

__all__ = ["GPTModel", "Sublayer", "count_parameters", "flops_per_token", "padded_vocab_size"]

# Parameter names ending like this are residual-branch outputs: their init is scaled by depth.
OUTPUT_PROJECTIONS = (".wo", ".w_down", ".out_proj")


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
        self.rotary = build_rotary(cfg)
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = build_sublayers(cfg)
        self.final_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, self.vocab_size, bias=False)
        n = len(cfg.pattern)
        self.mtp = nn.ModuleList(MTPDepth(cfg, n + 2 * k) for k in range(cfg.mtp_num_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, std) weights; output projections (expert down projections too) scaled by
        1/sqrt(2 * depth); zero biases, sink logits and expert-bias buffers; unit norms (set by the
        norm modules themselves); Mamba's A, D, dt and conv by the mixer."""
        std = self.cfg.init_method_std
        out_std = std / math.sqrt(2.0 * self.cfg.num_transformer_layers) if self.cfg.scaled_init else std
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, out_std if name.endswith(OUTPUT_PROJECTIONS) else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif getattr(module, "sinks", None) is not None:
                nn.init.zeros_(module.sinks)
            elif hasattr(module, "reset_ssm_parameters"):
                module.reset_ssm_parameters()
            elif hasattr(module, "init_weights"):  # MoE experts and routers (stacked weights)
                module.init_weights(std, out_std)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Normalised hidden states (batch, seq, hidden) -> logits (batch, seq, vocab)."""
        if self.output is None:
            return nn.functional.linear(h, self.embedding.weight)
        return self.output(h)

    def forward(self, tokens: torch.Tensor, ctx=None, return_mtp: bool = False):
        """tokens (batch, seq) -> logits (batch, seq, vocab);
        with return_mtp, (logits, [logits of MTP depth k = 1..D]) where depth k predicts t_{i+k+1}."""
        if ctx is None:
            ctx = PackedContext.for_tokens(tokens)
        h = self.embedding(tokens)
        if self.position_embedding is not None:
            h = h + self.position_embedding(ctx.positions)
        if self.rotary is not None:
            ctx.rope = self.rotary(ctx.positions)
        if self.training and self.embedding_dropout.p > 0:  # the identity otherwise: no call
            h = self.embedding_dropout(h)
        for layer in self.layers:
            h = layer(h, ctx)
        logits = self.head(self.final_norm(h))
        if not return_mtp:
            return logits
        mtp_logits = []
        for k, depth in enumerate(self.mtp, start=1):
            h = depth(h, self.embedding(shift_left(tokens, k)), ctx)
            mtp_logits.append(self.head(depth.final_norm(h)))
        return logits, mtp_logits
