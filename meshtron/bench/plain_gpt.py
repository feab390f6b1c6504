"""The plain PyTorch baseline of the throughput benchmark: a GPT of meshtron's shape written the way
one writes it by hand (pre-norm blocks, RoPE tables computed once, `scaled_dot_product_attention`
with `is_causal=True`) and a minimal loop (autocast, cross-entropy, backward, `clip_grad_norm_`, AdamW).

It imports nothing from meshtron's model code, so it measures what the framework adds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.config.schema import ModelConfig, OptimizerConfig, RunConfig

PLAIN_NORMS = {"RMSNorm": nn.RMSNorm, "LayerNorm": nn.LayerNorm}
PLAIN_ACTIVATIONS = {"swiglu": F.silu, "gelu": F.gelu}  # swiglu is gated: down(silu(x Wg) * x Wu)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class PlainBlock(nn.Module):
    # Parameters are registered in meshtron's order (norm, q, k, v, o, norm, gate, up, down) so that
    # weights can be copied across by position.
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd, gated = cfg.hidden_size, cfg.head_dim, cfg.activation == "swiglu"
        self.head_dim, self.gqa = hd, cfg.num_kv_heads != cfg.num_attention_heads
        self.attn_norm = PLAIN_NORMS[cfg.normalization](d, eps=cfg.norm_epsilon)
        self.wq = nn.Linear(d, cfg.num_attention_heads * hd, bias=False)
        self.wk = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)
        self.mlp_norm = PLAIN_NORMS[cfg.normalization](d, eps=cfg.norm_epsilon)
        self.w_gate = nn.Linear(d, cfg.ffn_size, bias=False) if gated else None
        self.w_up = nn.Linear(d, cfg.ffn_size, bias=False)
        self.w_down = nn.Linear(cfg.ffn_size, d, bias=False)
        self.act = PLAIN_ACTIVATIONS[cfg.activation]

    def forward(self, h: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]) -> torch.Tensor:
        batch, seq, _ = h.shape
        x = self.attn_norm(h)
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if cos is not None:  # (batch, heads, seq, head_dim) rotated by (seq, head_dim)
            q = (q * cos + rotate_half(q) * sin).type_as(q)
            k = (k * cos + rotate_half(k) * sin).type_as(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        h = h + self.wo(y.transpose(1, 2).reshape(batch, seq, -1))
        x = self.mlp_norm(h)
        up = self.act(self.w_gate(x)) * self.w_up(x) if self.w_gate is not None else self.act(self.w_up(x))
        return h + self.w_down(up)


class PlainGPT(nn.Module):
    def __init__(self, cfg: ModelConfig, padded_vocab: int):
        super().__init__()
        self.embedding = nn.Embedding(padded_vocab, cfg.hidden_size)
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = PLAIN_NORMS[cfg.normalization](cfg.hidden_size, eps=cfg.norm_epsilon)
        self.output = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, padded_vocab, bias=False)
        self.rope = cfg.position_embedding_type == "rope"
        # RoPE tables computed once for every position, sliced per forward.
        hd = cfg.head_dim
        inv_freq = (1.0 / cfg.rotary_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)).float()
        angles = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)  # (max_seq, head_dim)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = (self.cos[:seq], self.sin[:seq]) if self.rope else (None, None)
        h = self.embedding(tokens)
        for block in self.blocks:
            h = block(h, cos, sin)
        h = self.final_norm(h)
        return F.linear(h, self.embedding.weight if self.output is None else self.output.weight)


# Model fields the baseline implements; every other model field (windows, sinks, QK-norm, MLA, MTP,
# RoPE scaling, biases, dropout, ...) must keep its default, which is "off".
PLAIN_MODEL_FIELDS = frozenset({
    "layer_pattern", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "ffn_hidden_size", "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings",
    "position_embedding_type", "rotary_base", "normalization", "norm_epsilon", "activation", "tie_word_embeddings",
    "init_method_std", "scaled_init",
})


def check_plain_supports(cfg: RunConfig) -> None:
    """The baseline is minimal on purpose; a shape it cannot express is refused, never approximated."""
    m, defaults = cfg.model, ModelConfig()
    for f in dataclasses.fields(ModelConfig):
        value, default = getattr(m, f.name), getattr(defaults, f.name)
        if f.name not in PLAIN_MODEL_FIELDS and value != default:
            raise ConfigError(f"model.{f.name}: {value!r} is not supported by the plain baseline; keep {default!r}")
    refusals = [
        ("model.layer_pattern", m.pattern != "*-" * m.num_layers, "leave it empty (alternating attention and MLP)"),
        ("model.activation", m.activation not in PLAIN_ACTIVATIONS, f"use one of: {', '.join(PLAIN_ACTIVATIONS)}"),
        ("model.position_embedding_type", m.position_embedding_type == "learned_absolute", "use rope or none"),
        ("data.reset_attention_mask", cfg.data.reset_attention_mask or cfg.data.reset_position_ids,
         "the baseline trains plain causal sequences"),
        ("optimizer.type", cfg.optimizer.type != "adam" or not cfg.optimizer.decoupled_weight_decay,
         "the baseline uses AdamW (type adam, decoupled_weight_decay true)"),
        ("parallel.compile", cfg.parallel.compile or cfg.parallel.activation_checkpoint != "none",
         "the baseline runs eager without recompute (compile false, activation_checkpoint none)"),
        ("train.init_from_hf", bool(cfg.train.init_from_hf), "the baseline starts from meshtron's own init"),
    ]
    for name, bad, allowed in refusals:
        if bad:
            raise ConfigError(f"{name}: not supported by the plain baseline; {allowed}")


class PlainLoop:
    """Forward under autocast, masked cross-entropy summed over the global batch's tokens, backward
    per micro-batch, clip, AdamW with no decay on 1-D parameters: the same math as the trainer."""

    def __init__(self, model: nn.Module, ocfg: OptimizerConfig, device: torch.device, precision: str):
        self.model, self.device = model, device
        self.clip = ocfg.clip_grad if ocfg.clip_grad > 0 else float("inf")
        groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": ocfg.weight_decay},
                  {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=ocfg.lr, betas=(ocfg.adam_beta1, ocfg.adam_beta2),
                                           eps=ocfg.adam_eps)
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16" else nullcontext

    def loss(self, mb: dict[str, torch.Tensor], num_tokens: float) -> torch.Tensor:
        return token_loss(self.model, mb, self.device, self.autocast, num_tokens)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        num_tokens = sum(float(mb["loss_mask"].sum()) for mb in micro_batches)
        total = torch.zeros((), device=self.device)
        for mb in micro_batches:
            loss = self.loss(mb, num_tokens)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def token_loss(model: nn.Module, mb: dict[str, torch.Tensor], device: torch.device,
               autocast: Callable[[], Any], num_tokens: float) -> torch.Tensor:
    """Sum of masked token cross-entropies of one micro-batch divided by the global batch's token count."""
    ids, labels, mask = (mb[k].to(device, non_blocking=True) for k in ("input_ids", "labels", "loss_mask"))
    with autocast():
        logits = model(ids)  # (batch, seq, vocab)
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return (losses * mask.flatten()).sum() / num_tokens


def build_plain(meshtron_model: nn.Module, cfg: RunConfig, device: torch.device) -> PlainLoop:
    """A baseline holding a copy of meshtron's initial weights, so both loops compute the same function."""
    check_plain_supports(cfg)
    model = PlainGPT(cfg.model, meshtron_model.vocab_size).to(device)
    src, dst = list(meshtron_model.parameters()), list(model.parameters())
    num_src, num_dst = sum(p.numel() for p in src), sum(p.numel() for p in dst)
    assert num_src == num_dst, f"plain baseline has {num_dst} parameters, meshtron {num_src}: the shapes differ"
    assert [p.shape for p in src] == [p.shape for p in dst], "parameter order or shapes differ from meshtron's"
    with torch.no_grad():
        for s, d in zip(src, dst):
            d.copy_(s)
    return PlainLoop(model, cfg.optimizer, device, cfg.train.precision)
