"""torchao (the PyTorch quantization library), an optional dependency (`pip install meshtron[quant]`):
its quiet lazy import and the float8 hardware check, shared by quantized inference weights
(`inference/quantize.py`) and float8 training (`parallel/float8.py`)."""

from __future__ import annotations

import contextlib
import logging

import torch

from meshtron.config.fields import ConfigError

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

FLOAT8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later


@contextlib.contextmanager
def quiet_torchao_import():
    """torchao's import logs a warning for each prebuilt C++ extension that does not match this torch
    build (the mxfp8 / CUTLASS kernels: GPU-only, unused here) and torch logs a deprecation for an
    enum torchao registers with pytree. Neither concerns the user: raise those two loggers' level
    for the import only."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def import_torchao(field: str = "engine.quantize"):
    """-> the torchao module, imported quietly; one line naming `field` and the extra when it is missing."""
    try:
        with quiet_torchao_import():
            import torchao
            import torchao.quantization  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"{field}: needs torchao, which does not import ({e}): pip install 'meshtron[quant]'") from e
    return torchao


def has_float8(device: torch.device) -> bool:
    """Float8 matmuls need a CUDA GPU of compute capability >= 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FLOAT8_MIN_CAPABILITY
