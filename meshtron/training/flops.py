"""Peak FLOP/s for MFU: a configured value, or a square matmul measured in this process
(fp32 on CPU, where bf16 is far slower; the compute dtype on CUDA)."""

from __future__ import annotations

import time

import torch


def default_matmul_size(device: torch.device) -> int:
    """Matmul side that reaches the sustained rate: 2048 on CPU (1024 under-reads it by ~25%), 8192 on CUDA."""
    return 8192 if device.type == "cuda" else 2048


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int | None = None,
                         repeats: int = 5) -> float:
    """Best FLOP/s of `size`^3 matmuls on `device` (the best run is the closest to the peak);
    `size` defaults to `default_matmul_size(device)`."""
    size = size or default_matmul_size(device)
    gen = torch.Generator(device=device).manual_seed(0)  # leave the global RNG untouched
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / min(times)
