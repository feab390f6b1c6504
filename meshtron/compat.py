"""Private PyTorch APIs behind one module: each is used only through a function here that says when it
applies, so a PyTorch upgrade that moves or changes one is fixed in one place.

`PipelineStage._forward_metadata_inference`: before its first step a pipeline stage runs its module once
on placeholder tensors (uninitialised values) to learn output shapes; `during_pipeline_shape_inference`
lets a caller wrap that run (MoE layers must not count or record it).

`schedule_micro_batch`: the micro-batch index of the pipeline stage forward running now, read from
`PipelineStage.forward_one_chunk(fwd_chunk_id, ...)` on the call stack (None outside one, e.g. during
the metadata inference above); the schedules give no public way to ask.

`is_fake`: whether a tensor is a FakeTensor (shapes without data, e.g. `meshtron plan`'s trace); code
whose shapes depend on data (MoE routing) takes a static-shaped path then.

`torch._grouped_mm(x, w, offs)` multiplies consecutive row blocks of x (2-D) by the matrices of w (3-D):
rows offs[g-1]:offs[g] by w[g]. Measured on torch 2.13 (CPU): fp32/bf16/fp16 work forward and backward,
fp64 is refused, every row stride must be a multiple of 16 bytes, and backward fails on an expanded
(stride 0) output gradient, so the output passes through `_contiguous_grad`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

_GROUPED_DTYPES_CPU = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `grouped_mm(x, w, offs)` runs for these operands: x (rows, k), w (groups, k, n)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if x.device.type == "cpu":
        ok_dtype = x.dtype in _GROUPED_DTYPES_CPU
    elif x.device.type == "cuda":
        # the CUDA kernels take bf16 (fp32 on newer builds goes through a fallback we do not rely on)
        ok_dtype = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 8
    else:
        return False
    size = x.element_size()
    return ok_dtype and (w.shape[-2] * size) % 16 == 0 and (w.shape[-1] * size) % 16 == 0


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (rows, k) @ w[g] (k, n) for each row block g ending at offs[g] (int32, cumulative) -> (rows, n)."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))


def during_pipeline_shape_inference(stage, context: Callable[[], AbstractContextManager]) -> None:
    """Run `stage`'s placeholder forward (shape inference) inside `context()`; a no-op on PyTorch
    builds whose stages infer shapes another way."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return

    def wrapped(*args, **kwargs):
        with context():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = wrapped


def is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor, or a meta tensor: shapes only, no values to route by."""
    if t.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return bool(_is_fake(t))


def schedule_micro_batch() -> int | None:
    """The micro-batch index of the pipeline schedule's stage forward on the call stack, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "forward_one_chunk" and "fwd_chunk_id" in frame.f_locals:
            return int(frame.f_locals["fwd_chunk_id"])
        frame = frame.f_back
    return None
