"""Compute precision: `auto` means bf16 on CUDA and fp32 elsewhere (CPU runs and tests stay fp32);
on CUDA fp32 matmuls use TF32. Master weights, optimizer states and gradient reductions stay fp32 in
every precision: bf16 is autocast (or FSDP's param_dtype with fp32 reduce_dtype), never the weights'."""

from __future__ import annotations

from contextlib import nullcontext

import torch

TRAIN_PRECISIONS = ("auto", "fp32", "bf16")
ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """train.precision -> "fp32" or "bf16": auto is bf16 on CUDA (tensor cores), fp32 on a CPU."""
    if precision not in TRAIN_PRECISIONS:
        raise ValueError(f"train.precision: {precision!r} is not allowed; choose one of {', '.join(TRAIN_PRECISIONS)}")
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def resolve_engine_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """engine.dtype -> the dtype of the served weights (and so of the KV cache): auto is bfloat16 on
    CUDA (half the cache memory of float32, and the flash kernels), float32 on a CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"engine.dtype: {dtype!r} is not allowed; choose auto, {', '.join(ENGINE_DTYPES)}")
    return ENGINE_DTYPES[dtype]


def enable_tf32(device: torch.device) -> bool:
    """On CUDA let fp32 matmuls use TF32 tensor cores (cuDNN convolutions already do by default);
    elsewhere change nothing. -> whether it was enabled."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    return True


def autocast(device: torch.device, precision: str):
    """The forward's context for a resolved precision: bf16 autocast, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
