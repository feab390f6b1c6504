"""Peak FLOP/s for MFU and HBM bandwidth: a configured value, a known GPU's datasheet (dense
tensor-core peak of the compute precision; bandwidth for the serve benchmark), or a square matmul
measured in this process (the compute dtype on a GPU missing from the table; fp32 on a CPU, measured
once per machine and cached)."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

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


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's datasheet numbers: dense (no structured sparsity) tensor-core FLOP/s and HBM bandwidth."""

    name: str
    bf16_flops: float   # dense BF16/FP16 tensor core
    tf32_flops: float   # dense TF32 tensor core (what fp32 matmuls run at with TF32 on)
    bandwidth_gbps: float


# Keyed by a substring of torch.cuda.get_device_name(), most specific first (an "H100 PCIe" also
# contains "H100"). NVIDIA's datasheets print sparse figures for tensor cores: these are half of them.
GPU_SPECS: tuple[tuple[str, GpuSpec], ...] = (
    ("H200 NVL", GpuSpec("H200 NVL", 835.5e12, 417.5e12, 4800.0)),
    ("H200", GpuSpec("H200 SXM", 989.4e12, 494.7e12, 4800.0)),
    ("H100 NVL", GpuSpec("H100 NVL", 835.5e12, 417.5e12, 3900.0)),
    ("H100 PCIe", GpuSpec("H100 PCIe", 756.5e12, 378.0e12, 2000.0)),
    ("H100", GpuSpec("H100 SXM", 989.4e12, 494.7e12, 3350.0)),
    ("A100 80GB PCIe", GpuSpec("A100 80GB PCIe", 312e12, 156e12, 1935.0)),
    ("A100-PCIE-40GB", GpuSpec("A100 40GB PCIe", 312e12, 156e12, 1555.0)),
    ("A100-SXM4-40GB", GpuSpec("A100 40GB SXM", 312e12, 156e12, 1555.0)),
    ("A100", GpuSpec("A100 80GB SXM", 312e12, 156e12, 2039.0)),
    ("L40S", GpuSpec("L40S", 362.05e12, 183.0e12, 864.0)),
    ("B200", GpuSpec("B200", 2250e12, 1100e12, 8000.0)),
)


def gpu_spec(device_name: str) -> Optional[GpuSpec]:
    """The datasheet entry of a CUDA device name (e.g. "NVIDIA H100 80GB HBM3"); None if unknown."""
    for key, spec in GPU_SPECS:
        if key.lower() in device_name.lower():
            return spec
    return None


def resolve_peak_flops(configured: Optional[float], device: torch.device, precision: str) -> tuple[float, str]:
    """The peak FLOP/s MFU divides by, and where it came from: the configured value; on a known GPU the
    datasheet's dense peak of the compute precision (bf16, or TF32 for fp32); on an unknown GPU a
    measured matmul (which reads below the datasheet, so MFU reads high: the note says so); on a CPU
    the measured fp32 matmul (bf16 speed depends on the CPU's instructions)."""
    if configured:
        return configured, "train.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = gpu_spec(name)
        if spec is not None:
            bf16 = precision == "bf16"
            return (spec.bf16_flops if bf16 else spec.tf32_flops), f"datasheet {spec.name} dense {'bf16' if bf16 else 'tf32'}"
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        return (measure_matmul_flops(device, dtype),
                f"measured {str(dtype)[6:]} matmul: {name!r} is not in the datasheet table, so MFU reads high; "
                "set train.peak_flops")
    return cpu_peak_flops()


def peak_cache_path() -> Path:
    """Where measured CPU peaks are kept: $XDG_CACHE_HOME/meshtron (default ~/.cache/meshtron)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshtron" / "peak_flops.json"


def cpu_key() -> str:
    """What a CPU measurement holds for: this machine, its CPU model, torch's thread count and version."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{platform.node()} | {model} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def cpu_peak_flops() -> tuple[float, str]:
    """The fp32 matmul peak of this CPU, measured once per machine (1.5-5 s) and kept in
    `peak_cache_path()` keyed by `cpu_key()`; later runs read it. Delete the file to measure again,
    or set train.peak_flops."""
    path, key = peak_cache_path(), cpu_key()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    value = cache.get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value), f"measured fp32 matmul, cached in {path}"
    value = measure_matmul_flops(torch.device("cpu"), torch.float32)
    try:   # best effort: a read-only home only costs the next run the measurement again
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cache, key: value}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return value, "measured fp32 matmul"


def measure_copy_bandwidth_gbps(device: torch.device, num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best device-to-device copy rate in GB/s (each byte read once and written once)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * num_bytes / min(times[1:]) / 1e9


def resolve_bandwidth_gbps(given: Optional[float], device: torch.device) -> tuple[float, str]:
    """A CUDA device's HBM bandwidth in GB/s and where it came from: the given value, the datasheet of
    a known GPU, or a measured copy (below the datasheet: fractions of it read high) for an unknown one."""
    if given:
        return given, "given"
    name = torch.cuda.get_device_name(device)
    spec = gpu_spec(name)
    if spec is not None:
        return spec.bandwidth_gbps, f"datasheet {spec.name}"
    return measure_copy_bandwidth_gbps(device), f"measured device copy: {name!r} is not in the datasheet table"
