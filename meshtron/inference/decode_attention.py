"""Which attention the varlen layout uses (`engine.decode_attention`).

`auto` (the default) takes the fastest one available: on a CPU the native C kernel
(`native_attention`) for the decode buckets when the model is float32 and the kernel builds, else
gather + SDPA; on CUDA `flex` (`flex_paged_attention`: one compiled FlexAttention call per layer for
decodes and prefill chunks together, reading the cache through the block tables) when some attention
layer has a plain softmax, else gather + SDPA. Other layouts have no decode buckets; with gather,
compiled or native, layers with attention sinks gather (`varlen_context`), with flex they take the
flex call too. One log line per process says what `auto` picked and, after a fallback, why.
`gather`, `compiled`, `native` and `flex` force a choice; a forced `native` that cannot run is a
ConfigError. CUDA graph replays keep their own fixed-shape layout (`cuda_graphs`) whatever the choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.inference.config import EngineConfig
from meshtron.inference.flex_paged_attention import FlexPagedAttention
from meshtron.inference.flex_paged_attention import unavailable_reason as flex_unavailable_reason
from meshtron.inference.fused_attention import compiled_decode_attention
from meshtron.inference.native_attention import (
    check_native_decode_attention,
    native_decode_attention,
    unavailable_reason,
)

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

log = logging.getLogger("meshtron.engine")
_noticed: set[str] = set()

DecodeAttention = Callable[..., torch.Tensor]


def _notice(level: int, message: str) -> None:
    if message not in _noticed:
        _noticed.add(message)
        log.log(level, "%s", message)


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    return [layer for layer in getattr(model, "layers", ()) if getattr(layer, "symbol", None) == "*"]


def _vanilla_attention(model: nn.Module) -> bool:
    """Whether some attention layer has a plain softmax (layers with sinks gather but with flex: `varlen_context`)."""
    return any(getattr(layer.mixer, "softmax_type", "vanilla") == "vanilla" for layer in _attention_layers(model))


def select_decode_attention(model: nn.Module, cfg: EngineConfig,
                            device: torch.device) -> tuple[str, Optional[DecodeAttention]]:
    """-> (the choice: gather, compiled, native or flex; the function, None for gather + SDPA)."""
    choice = cfg.decode_attention
    flex_reason = flex_unavailable_reason(cfg.block_size, device)
    if cfg.layout == "varlen" and choice == "flex" and _attention_layers(model):
        if flex_reason is not None:
            raise ConfigError(f"engine.decode_attention: 'flex' is not available: {flex_reason}; "
                              "change the block size or choose another decode_attention")
        return "flex", FlexPagedAttention(compiled=device.type == "cuda")
    if cfg.layout != "varlen" or not _vanilla_attention(model):
        return "gather", None  # other layouts have no decode buckets; nothing else would call the function
    if choice in ("gather", "flex"):  # flex without attention layers has nothing to do
        return "gather", None
    if choice == "compiled":
        return "compiled", compiled_decode_attention
    if choice == "native":
        check_native_decode_attention(model, device)
        return "native", native_decode_attention
    if device.type == "cuda" and flex_reason is None:
        _notice(logging.INFO, "engine.decode_attention auto: flex (compiled FlexAttention reading the paged cache)")
        return "flex", FlexPagedAttention(compiled=True)
    reason = flex_reason if device.type == "cuda" else unavailable_reason(model, device)
    if reason is None:
        _notice(logging.INFO, "engine.decode_attention auto: native (the C kernel; CPU, float32)")
        return "native", native_decode_attention
    # on a CPU the fallback costs speed the user may want back; elsewhere it is the expected choice
    level = logging.WARNING if device.type == "cpu" else logging.INFO
    _notice(level, f"engine.decode_attention auto: gather + SDPA, because {reason}")
    return "gather", None
