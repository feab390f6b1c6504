"""Which function the varlen layout's decode buckets use (`engine.decode_attention`).

`auto` (the default) takes the fastest one available: on a CPU the native C kernel
(`native_attention`) when the model is float32 and the kernel builds, else gather + SDPA; on CUDA
gather + SDPA, which runs on the GPU's own attention kernels and inside CUDA graphs (the native
kernel is CPU code). Other layouts have no decode buckets, and layers with attention sinks always
gather (`varlen_context`). One log line per process says what `auto` picked and, after a fallback, why.
`gather`, `compiled` and `native` force a choice; a forced `native` that cannot run is a ConfigError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from meshtron.inference.config import EngineConfig
from meshtron.inference.fused_attention import compiled_decode_attention
from meshtron.inference.native_attention import (
    check_native_decode_attention,
    native_decode_attention,
    unavailable_reason,
)

log = logging.getLogger("meshtron.engine")
_noticed: set[str] = set()

DecodeAttention = Callable[..., torch.Tensor]


def _notice(level: int, message: str) -> None:
    if message not in _noticed:
        _noticed.add(message)
        log.log(level, "%s", message)


def _vanilla_attention(model: nn.Module) -> bool:
    """Whether some attention layer has a plain softmax (layers with sinks always gather: `varlen_context`)."""
    return any(getattr(layer, "symbol", None) == "*" and getattr(layer.mixer, "softmax_type", "vanilla") == "vanilla"
               for layer in getattr(model, "layers", ()))


def select_decode_attention(model: nn.Module, cfg: EngineConfig,
                            device: torch.device) -> tuple[str, Optional[DecodeAttention]]:
    """-> (the choice: gather, compiled or native; the function, None for gather + SDPA)."""
    choice = cfg.decode_attention
    if cfg.layout != "varlen" or not _vanilla_attention(model):
        return "gather", None  # other layouts have no decode buckets; nothing else would call the function
    if choice == "gather":
        return "gather", None
    if choice == "compiled":
        return "compiled", compiled_decode_attention
    if choice == "native":
        check_native_decode_attention(model, device)
        return "native", native_decode_attention
    reason = unavailable_reason(model, device)
    if reason is None:
        _notice(logging.INFO, "engine.decode_attention auto: native (the C kernel; CPU, float32)")
        return "native", native_decode_attention
    # on a CPU the fallback costs speed the user may want back; on CUDA it is the expected choice
    level = logging.WARNING if device.type == "cpu" else logging.INFO
    _notice(level, f"engine.decode_attention auto: gather + SDPA, because {reason}")
    return "gather", None
