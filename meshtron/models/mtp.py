"""Multi-token prediction (MTP, DeepSeek-V3): extra depths that predict tokens further ahead.

Depth k (k = 1..D) at position i combines the previous depth's hidden state with the embedding of
token t_{i+k} (shared embedding), runs one attention and one MLP sublayer, and predicts t_{i+k+1}
through the shared output head:
    h_k(i) = Block_k(W_k [norm_h(h_{k-1}(i)); norm_e(Emb(t_{i+k}))]),   logits_k(i) = Head(norm_k(h_k(i)))
with h_0 the main model's last hidden state (before its final norm). The training loss adds
    L = L_main + (lambda / D) * sum_k L_k,
where L_k is the token-summed cross-entropy of depth k over the positions whose target exists:
labels and loss mask shift left by k, the last k positions and positions whose shifted token lies
in another packed document are masked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from meshtron.config.schema import ModelConfig
from meshtron.models.blocks import Sublayer
from meshtron.nn.loss import masked_cross_entropy
from meshtron.nn.norm import build_norm


class MTPDepth(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        """`layer_id` numbers this depth's attention after the main pattern (it keys the KV cache)."""
        super().__init__()
        d = cfg.hidden_size
        self.hidden_norm = build_norm(cfg.normalization, d, cfg.norm_epsilon)
        self.embed_norm = build_norm(cfg.normalization, d, cfg.norm_epsilon)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        # Windowed like the main model only when every main attention layer is windowed.
        every_window = cfg.window_size is not None and all(
            cfg.is_window_layer(i) for i in range(cfg.pattern.count("*")))
        self.layers = nn.ModuleList([Sublayer("*", cfg, layer_id, cfg.window_size if every_window else None),
                                     Sublayer("-", cfg, layer_id + 1)])
        self.final_norm = build_norm(cfg.normalization, d, cfg.norm_epsilon)

    def forward(self, hidden: torch.Tensor, shifted_embeddings: torch.Tensor, ctx) -> torch.Tensor:
        """hidden, shifted_embeddings (batch, seq, hidden) -> this depth's hidden state (before final_norm)."""
        h = self.eh_proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(shifted_embeddings)], dim=-1))
        for layer in self.layers:
            h = layer(h, ctx)
        return h


def shift_left(x: torch.Tensor, k: int, fill: int = 0) -> torch.Tensor:
    """x (batch, seq) -> y with y[:, i] = x[:, i + k], the last k positions set to `fill`."""
    out = torch.full_like(x, fill)
    out[:, : x.shape[1] - k] = x[:, k:]
    return out


def mtp_targets(labels: torch.Tensor, loss_mask: Optional[torch.Tensor], document_ids: Optional[torch.Tensor],
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and 0/1 loss mask of depth k: position i predicts labels[i + k] when it exists and
    belongs to the same document as position i."""
    mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
    mask = shift_left(mask, k, 0)
    if document_ids is not None:
        mask = mask * (shift_left(document_ids, k, -1) == document_ids).float()
    return shift_left(labels, k, 0), mask


def forward_for_loss(model: nn.Module, tokens: torch.Tensor, ctx) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits, MTP depth logits): the depths run only in training mode of a model that has them."""
    if model.cfg.mtp_num_layers == 0 or not model.training:
        return model(tokens, ctx), []
    return model(tokens, ctx, return_mtp=True)


def combine_losses(logits: torch.Tensor, mtp_logits: list[torch.Tensor], labels: torch.Tensor,
                   loss_mask: Optional[torch.Tensor], document_ids: Optional[torch.Tensor], cfg: ModelConfig,
                   cross_entropy: Callable = masked_cross_entropy) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The training objective: (loss sum, loss tokens, extras).

    Without MTP depth logits this is the masked cross-entropy of the logits and no extras. With them
    the sum is L_main + (lambda / D) sum_k L_k (token sums; the caller divides by the main token
    count) and extras holds {'lm_loss': (sum, count), 'mtp_k_loss': (sum, count), ...} for logging.
    """
    loss, count = cross_entropy(logits, labels, loss_mask)
    if not mtp_logits:
        return loss, count, {}
    extras = {"lm_loss": (loss.detach(), count)}
    total = loss
    weight = cfg.mtp_loss_scaling_factor / len(mtp_logits)
    for k, logits_k in enumerate(mtp_logits, start=1):
        targets, mask = mtp_targets(labels, loss_mask, document_ids, k)
        depth_loss, depth_count = cross_entropy(logits_k, targets, mask)
        total = total + weight * depth_loss
        extras[f"mtp_{k}_loss"] = (depth_loss.detach(), depth_count)
    return total, count, extras
