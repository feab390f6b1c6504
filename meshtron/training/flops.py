"""Peak FLOP/s for MFU: a configured value, or a square matmul measured in this process
(fp32 on CPU, where bf16 is far slower; the compute dtype on CUDA)."""

from __future__ import annotations

import time

import torch


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int | None = None,
                         repeats: int = 5) -> float:
    """Best FLOP/s of `size`^3 matmuls on `device` (the best run is the closest to the peak).

    2048^3 on CPU (1024^3 under-reads the peak by ~25% there), 8192^3 on CUDA.
    """
    size = size or (8192 if device.type == "cuda" else 2048)
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
