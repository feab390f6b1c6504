"""masked_cross_entropy equals PyTorch's cross-entropy on upcast logits (loss and gradient, in fp32
and bf16, across chunk boundaries, with a mask and ignored labels) without allocating a
full-vocabulary fp32 copy of the logits (largest allocation counted with a dispatch mode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.nn.loss import masked_cross_entropy


def reference(logits, labels, mask):
    """The former implementation: a full fp32 copy of the logits into F.cross_entropy."""
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    m = mask.flatten().float()
    return (losses * m).sum(), m.sum()


def inputs(dtype, batch=3, seq=7, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(batch, seq, vocab, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, 2] = -100   # ignored: loss 0, no gradient (F.cross_entropy's default ignore_index)
    mask = (torch.rand(batch, seq, generator=g) > 0.3).long()
    return logits, labels, mask


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("chunk_rows", [None, 1, 4])   # one chunk; every row; 21 rows in chunks of 4
def test_matches_pytorch_cross_entropy(dtype, atol, chunk_rows):
    logits, labels, mask = inputs(dtype)
    loss, count = masked_cross_entropy(logits, labels, mask, chunk_rows=chunk_rows)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_loss, ref_count = reference(logits, labels, mask)
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)
    assert count == ref_count and grad.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=atol, rtol=0)
    assert grad[0, 2].abs().max() == 0   # the ignored label


def test_without_a_mask_counts_every_token():
    logits, labels, _ = inputs(torch.float32)
    labels[0, 2] = 1
    loss, count = masked_cross_entropy(logits, labels)
    assert count == labels.numel()
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))


class LargestAllocation(TorchDispatchMode):
    """The bytes of the largest tensor any op returns, and how many ops return (rows, vocab)-sized fp32."""

    def __init__(self, full_numel: int):
        super().__init__()
        self.full_numel, self.largest, self.full_fp32 = full_numel, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and func not in (torch.ops.aten.view.default, torch.ops.aten.slice.Tensor,
                                                            torch.ops.aten.detach.default):
                self.largest = max(self.largest, t.numel() * t.element_size())
                self.full_fp32 += t.dtype == torch.float32 and t.numel() == self.full_numel
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_full_fp32_copy_of_the_logits(dtype):
    """bf16: the largest allocation is the gradient (logits-sized, bf16), where the former loss also
    made a fp32 copy (twice the bytes) and a fp32 log-softmax. fp32: one full-size tensor (the
    gradient), where the former loss also kept the log-softmax for backward."""
    batch, seq, vocab = 2, 64, 512
    logits, labels, mask = inputs(dtype, batch, seq, vocab)
    logits_bytes = logits.numel() * logits.element_size()

    def measure(loss_fn, **kwargs):
        with LargestAllocation(logits.numel()) as mode:
            loss, _ = loss_fn(logits, labels, mask, **kwargs)
            torch.autograd.grad(loss, logits)
        return mode

    old = measure(reference)
    new = measure(masked_cross_entropy, chunk_rows=16)
    assert old.largest >= (2 * logits_bytes if dtype == torch.bfloat16 else logits_bytes)
    assert old.full_fp32 >= 2                              # the check can tell the old loss apart
    assert new.largest == logits_bytes                     # the gradient, in the logits' dtype
    assert new.full_fp32 == (1 if dtype == torch.float32 else 0)
