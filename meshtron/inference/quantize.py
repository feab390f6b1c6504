"""Quantized weights for inference through torchao: after loading, the weight of every `nn.Linear` of
the model is replaced by one of torchao's quantized tensor subclasses, whose matmul dequantizes on
the fly. Activations and the KV cache keep the model's dtype. The token embedding (a row lookup) and
MoE expert weights (stacked tensors, not `nn.Linear`) stay as they are; an untied output head is an
`nn.Linear` and is quantized like the others (torchao's default, as in gpt-fast), a tied one is the
embedding and stays. torchao is an optional dependency (`pip install meshtron[quant]`), imported here
only when a mode other than `none` is asked for.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.inference.config import EngineConfig
from meshtron.nn.torchao import has_float8, import_torchao, quiet_torchao_import

QUANTIZE_MODES = EngineConfig.QUANTIZE_MODES
logger = logging.getLogger(__name__)
INT4_GROUP_SIZE = 128  # int4: one scale and zero point per 128 input features
INT4_OUT_MULTIPLE = 16  # int4: the packed layouts tile output features by 16 (CPU) or 8 (CUDA)


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def check_quantize(mode: str, device: torch.device, dtype: Optional[torch.dtype] = None,
                   field: str = "engine.quantize") -> None:
    """Refuse (ConfigError), in one line naming `field`, a mode this device (and weight dtype) cannot run."""
    if mode not in QUANTIZE_MODES:
        raise ConfigError(f"{field}: {mode!r} is not allowed; choose one of {', '.join(QUANTIZE_MODES)}")
    if mode.startswith("float8") and not has_float8(device):
        raise ConfigError(f"{field}: {mode} needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper or "
                         f"later) for float8 matmuls; this engine runs on {_device_name(device)}: use "
                         "int8-weight-only or none")
    if mode == "int4-weight-only" and device.type == "cuda" and dtype not in (None, torch.bfloat16):
        raise ConfigError(f"{field}: int4-weight-only on CUDA runs torchao's tinygemm kernel, which takes bfloat16 "
                         f"weights and activations (the weights are {dtype}): set engine.dtype bfloat16")
    if mode == "int4-weight-only" and device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{field}: int4-weight-only has torchao kernels for a CPU and CUDA only, not "
                         f"{_device_name(device)}: use int8-weight-only or none")


def _torchao_config(mode: str, device: torch.device):
    """The torchao config of a mode. set_inductor_config=False: the engine runs eagerly, so
    torchao must not change inductor's global settings."""
    import_torchao()
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int4WeightOnlyConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    if mode == "int8-weight-only":  # symmetric, one scale per output feature
        return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
    if mode == "int4-weight-only":
        if device.type == "cpu":
            # the default int4 packing needs the mslk GPU kernels; on a CPU torchao's packed format for
            # aten._weight_int4pack_mm_for_cpu (asymmetric, per group) lives in its prototype workflows
            from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

            return PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, set_inductor_config=False)
        from torchao.quantization.quantize_.workflows import Int4PackingFormat

        return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D,
                                    set_inductor_config=False)
    if mode == "float8-weight-only":
        return Float8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
    assert mode == "float8-dynamic", mode
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def quantize_model(model: nn.Module, mode: str, device: Optional[torch.device] = None) -> nn.Module:
    """Quantize the weights of `model`'s linear layers in place (see the module docstring) and
    return it; `none` returns it unchanged. device: where it runs (default: where its parameters are).
    Refuses (ConfigError, a ValueError: one line) a mode the device cannot run and a tensor-parallel model."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    check_quantize(mode, device, dtype)
    if mode == "none":
        return model
    if _is_sharded(model):
        # measured with torchao 0.18: its quantized tensors inside DTensor shards fail in the forward
        # (aten.view is not implemented for Int8Tensor), and quantize_ on a DTensor weight drops the sharding
        raise ConfigError(f"engine.quantize: {mode} cannot be combined with tensor-parallel serving (torchao's "
                         "quantized weights do not run as DTensor shards); serve in one process (not under torchrun), or "
                         "with quantize none")
    done = getattr(model, "quantization", "none")
    if done != "none":
        raise ConfigError(f"engine.quantize: the model is already quantized ({done}); load it again to change mode")
    config = _torchao_config(mode, device)
    from torchao.quantization import quantize_

    with torch.no_grad(), quiet_torchao_import():
        quantize_(model, config, filter_fn=_is_int4_shaped if mode == "int4-weight-only" else _is_linear,
                  device=device)
    model.quantization = mode
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    kept = sum(type(m.weight) is nn.Parameter for m in linears)
    logger.info("quantize %s: %d of %d linear layers quantized%s", mode, len(linears) - kept, len(linears),
                f" ({kept} kept in {dtype}: shapes the int4 kernels do not take)" if kept else "")
    return model


def _is_linear(module: nn.Module, fqn: str) -> bool:
    return type(module) is nn.Linear


def _is_int4_shaped(module: nn.Module, fqn: str) -> bool:
    """int4 packs groups of 128 input features and tiles of 16 output features (a byte vocabulary's
    257-row head is neither): other linears keep their dtype."""
    return (_is_linear(module, fqn) and module.in_features % INT4_GROUP_SIZE == 0
            and module.out_features % INT4_OUT_MULTIPLE == 0)
