"""Decode attention as a small C kernel (`csrc/paged_attention.c`): the engine's default decode
attention on a CPU (`engine.decode_attention`: auto picks it when it builds, see `decode_attention`).

The kernel reads each decode row's keys and values straight from the paged cache through its block
table, only the row's own positions (a bucket's padding costs nothing), each key once for all the
query heads that share it, with an online softmax a block at a time. On this project's 2-core CPU
it runs at several times the speed of the `torch.compile`-generated kernel (`fused_attention`),
whose score loop reduces every 64-wide dot product horizontally and which makes five passes over
the scores; see docs/serving.md.

The source is compiled on first use with the system C compiler (`$CC`, else `cc`, `gcc` or `clang`;
`-O3 -march=native`) into `$MESHTRON_CACHE_DIR/kernels` (default `~/.cache/meshtron/kernels`), one
file per source, compiler, flags and CPU, written under a temporary name and renamed into place (so
concurrent first builds are safe), and loaded with ctypes: no torch headers, no ninja, about half a
second of compiling (`torch.utils.cpp_extension.load_inline` was measured and not kept: see
docs/serving.md). Float32 CPU tensors only; rows split over `torch.get_num_threads()` threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

from meshtron.config.fields import ConfigError

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-pthread"]
_library: Optional[ctypes.CDLL] = None


def _compiler() -> Optional[str]:
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu() -> str:
    """What -march=native compiles for: a cache shared by different machines keeps one build per CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return platform.machine() + next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.machine() + platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("MESHTRON_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshtron"
    return Path(root) / "kernels"


class KernelBuildError(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why and what to do."""


_failure: Optional[str] = None  # why the first build in this process failed (not retried)


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        try:
            proc = subprocess.run([cc, *FLAGS, "-o", str(built), str(SOURCE), "-lm"], capture_output=True, text=True,
                                  timeout=300)
        except subprocess.TimeoutExpired:
            raise KernelBuildError(f"compiling {SOURCE.name} with {cc} took over 300 s") from None
        if proc.returncode != 0:
            err = proc.stderr.strip()
            raise KernelBuildError(f"compiling {SOURCE.name} with {cc} failed: "
                                   f"{err.splitlines()[-1] if err else f'exit status {proc.returncode}'}")
        os.replace(built, target)  # atomic: concurrent builders each write their own temporary file


def _load() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (set $CC, or install cc, gcc or clang)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, _cpu(), *FLAGS]).encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_attention-{key}.so"
    if not target.exists():
        _build(cc, target)
    return ctypes.CDLL(str(target))


def load_library() -> ctypes.CDLL:
    """Compile (once per source, compiler, flags and CPU) and load the kernel; KernelBuildError if it
    cannot (remembered: a process does not try twice)."""
    global _library, _failure
    if _library is not None:
        return _library
    if _failure is not None:
        raise KernelBuildError(_failure)
    try:
        lib = _load()
    except OSError as e:
        _failure = (f"cannot build or load it under {cache_dir()} ({e.strerror or e}); set $MESHTRON_CACHE_DIR to a "
                    "writable directory")
        raise KernelBuildError(_failure) from None
    except KernelBuildError as e:
        _failure = str(e)
        raise
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode_attention.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                           ctypes.c_float, i64]
    lib.paged_decode_attention.restype = ctypes.c_int
    _library = lib
    return lib


def checked_indices(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_blocks: torch.Tensor,
                    lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel trusts its indices: check that every read of q (rows, heads, dk) stays inside the
    table and the caches; -> key_blocks, lo, hi as contiguous int64 (ValueError otherwise)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"native decode attention: {name} must be float32 on the CPU, not {t.dtype} on {t.device}")
    key_blocks, lo, hi = (t.to(torch.int64).contiguous() for t in (key_blocks, lo, hi))
    rows, heads, dk = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads or k_cache.shape[3] != dk or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"native decode attention: q {tuple(q.shape)} does not fit the caches {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)} (contiguous, kv heads dividing the query heads)")
    if rows and (int(lo.min()) < 0 or int(hi.max()) >= key_blocks.shape[1] * block_size
                 or int(key_blocks.min()) < 0 or int(key_blocks.max()) >= k_cache.shape[0]
                 or v_cache.shape[:3] != k_cache.shape[:3] or lo.shape != (rows,) or hi.shape != (rows,)):
        raise ValueError("native decode attention: a key position or block id is out of range")
    return key_blocks, lo, hi


def _run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_blocks: torch.Tensor, lo: torch.Tensor,
         hi: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel call on indices `checked_indices` accepted -> (rows, heads, dv)."""
    q = q.contiguous()
    rows, heads, dk = q.shape
    out = q.new_empty(rows, heads, v_cache.shape[3])
    status = load_library().paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), key_blocks.data_ptr(), key_blocks.shape[1],
        lo.data_ptr(), hi.data_ptr(), out.data_ptr(), rows, heads, k_cache.shape[2], k_cache.shape[1], dk,
        v_cache.shape[3], float(scale), torch.get_num_threads())
    if status != 0:
        raise MemoryError("native decode attention: out of memory for its per-thread buffers")
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_blocks: torch.Tensor,
                           lo: torch.Tensor, hi: torch.Tensor, scale: float) -> torch.Tensor:
    """q (rows, heads, dk); caches (num_blocks + 1, block_size, kv_heads, d); key_blocks (rows, blocks);
    lo, hi (rows,) the first and last key position each row attends -> (rows, heads, dv)."""
    key_blocks, lo, hi = checked_indices(q, k_cache, v_cache, key_blocks, lo, hi)
    return _run(q, k_cache, v_cache, key_blocks, lo, hi, scale)


def native_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group,
                            window_size: Optional[int], scale: float) -> torch.Tensor:
    """A decode bucket (`varlen_context.AttentionGroup`; q (rows, heads, 1, dk)) through the kernel.
    Every layer of a step shares the group, so its checked indices are kept on it, per window and
    cache layout: one check per step instead of one per layer (four host reads each)."""
    key = (window_size, *((t.shape, t.dtype, t.device, t.is_contiguous()) for t in (q, k_cache, v_cache)))
    indices = group.native_indices.get(key)
    if indices is None:
        lo, hi = group.key_range(window_size)
        indices = group.native_indices[key] = checked_indices(q[:, :, 0], k_cache, v_cache, group.key_blocks, lo, hi)
    return _run(q[:, :, 0], k_cache, v_cache, *indices, scale)[:, :, None]


def unavailable_reason(model: torch.nn.Module, device: torch.device) -> Optional[str]:
    """Why the kernel cannot serve this model here (building it if need be), or None when it can."""
    dtype = next(model.parameters()).dtype
    if device.type != "cpu":
        return f"the native kernel runs on the CPU only (the engine is on {device.type})"
    if dtype != torch.float32:
        return f"the native kernel needs float32 weights (the model is {str(dtype).removeprefix('torch.')})"
    try:
        load_library()
    except KernelBuildError as e:
        return f"the native kernel cannot be built: {e}"
    return None


def check_native_decode_attention(model: torch.nn.Module, device: torch.device) -> None:
    """decode_attention 'native' asked for: build the kernel now (so a missing compiler fails at start-up)
    and check the model fits it; ConfigError naming the field otherwise."""
    reason = unavailable_reason(model, device)
    if reason is not None:
        raise ConfigError(f"engine.decode_attention: 'native' is not available: {reason}; "
                          "choose auto or gather")
