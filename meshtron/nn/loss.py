"""Token-level cross-entropy with a loss mask, returned as (sum of losses, number of tokens)
so that micro-batches and ranks can be normalised by the global token count.

The loss never holds a full-vocabulary fp32 copy of the logits: rows are upcast a chunk at a time
(fp32 accumulation for bf16 logits), only the log-sum-exp per token is kept for backward, and the
gradient is rebuilt chunk by chunk into one tensor of the logits' dtype (the one the model needs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# elements of one fp32 chunk (64 MiB): large enough that the loop over chunks costs nothing
CHUNK_ELEMENTS = 1 << 24
IGNORE_INDEX = -100   # F.cross_entropy's default: such labels give loss 0 and no gradient


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None,
                         chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (batch, seq, vocab), labels (batch, seq), loss_mask (batch, seq) of 0/1.
    chunk_rows: tokens upcast at a time (default: CHUNK_ELEMENTS // vocab)."""
    flat = logits.flatten(0, 1)
    if not hasattr(flat, "to_local"):  # plain (and fake, for `meshtron plan`) tensors
        rows = chunk_rows or max(1, CHUNK_ELEMENTS // flat.shape[-1])
        losses = ChunkedCrossEntropy.apply(flat, labels.flatten(), rows)
    else:   # a DTensor (vocab-parallel logits) keeps PyTorch's kernel
        losses = F.cross_entropy(flat.float(), labels.flatten(), reduction="none")
    if loss_mask is None:
        return losses.sum(), torch.tensor(labels.numel(), device=labels.device)
    mask = loss_mask.flatten().to(losses.dtype)
    return (losses * mask).sum(), mask.sum()


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token losses logsumexp(x) - x[label] (fp32) of logits x (tokens, vocab), chunk by chunk.
    Backward: d loss_i / d x_i = softmax(x_i) - onehot(label_i), recomputed per chunk from the saved
    log-sum-exp, scaled by the incoming per-token gradient and cast to the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        ignored = labels == IGNORE_INDEX
        targets = labels.masked_fill(ignored, 0)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        picked = torch.empty_like(lse)
        for start in range(0, logits.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            x = logits[part].float()
            lse[part] = torch.logsumexp(x, dim=-1)
            picked[part] = x.gather(1, targets[part, None]).squeeze(1)
        ctx.save_for_backward(logits, targets, ignored, lse)
        ctx.chunk_rows = chunk_rows
        return (lse - picked).masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        logits, targets, ignored, lse = ctx.saved_tensors
        scale = grad_losses.float().masked_fill(ignored, 0.0)
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            part = slice(start, start + ctx.chunk_rows)
            p = torch.exp(logits[part].float() - lse[part, None])          # softmax of the chunk, fp32
            p.scatter_add_(1, targets[part, None], torch.full_like(p[:, :1], -1.0))
            grad[part] = p.mul_(scale[part, None])
        return grad, None, None
