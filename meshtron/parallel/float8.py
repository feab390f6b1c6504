"""train.float8: float8 matmuls in training through torchao's `convert_to_float8_training`, as torchtitan
applies it. Each eligible `nn.Linear` becomes a `Float8Linear`: its weights stay in high precision
(so the optimizer, checkpoints and FSDP see ordinary parameters); every forward casts the input and the
weight to float8 e4m3 and the backward casts the output gradient to e5m2, each with one dynamic scale
per tensor (float8 max / amax), and multiplies them with `torch._scaled_mm`. Applied to the full model
before tensor parallelism, compile and FSDP (parallel.parallelize_parts)."""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.nn.torchao import FLOAT8_MIN_CAPABILITY, has_float8, import_torchao

# float8 matmuls need both dims of the weight to be multiples of 16 (torch._scaled_mm's alignment)
FLOAT8_DIM_MULTIPLE = 16


def check_float8_training(device: torch.device, tp: int = 1) -> None:
    """Refuse train.float8, in one line, where it cannot run."""
    if not has_float8(device):
        where = device.type if device.type != "cuda" else (
            f"{torch.cuda.get_device_name(device)} (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})")
        raise ConfigError(f"train.float8: float8 matmuls need a CUDA GPU with compute capability >= "
                          f"{'.'.join(map(str, FLOAT8_MIN_CAPABILITY))} (Ada, Hopper or later); this run is on "
                          f"{where}: set train.float8 false")
    if tp > 1:
        raise ConfigError("train.float8: not combined with tensor parallelism (the TP plans would need torchao's "
                          "float8 parallel styles); set parallel.tp 1 or train.float8 false")


def is_float8_eligible(module: nn.Module, fqn: str) -> bool:
    """torchtitan's rule: every linear but the output head, whose weight dims are multiples of 16.
    The head stays in high precision (its logits feed the loss directly; torchtitan skips it too)."""
    if fqn == "output" or fqn.endswith(".output"):
        return False
    return module.in_features % FLOAT8_DIM_MULTIPLE == 0 and module.out_features % FLOAT8_DIM_MULTIPLE == 0


def apply_float8_training(model: nn.Module, device: torch.device, tp: int = 1, emulate: bool = False) -> int:
    """Swap the eligible linears of `model` for torchao `Float8Linear`s (tensorwise dynamic scaling)
    in place; -> how many were swapped. emulate: torchao's float8 emulation (casts and an fp32
    matmul), which runs anywhere: for tests on a CPU, never for training."""
    if not emulate:
        check_float8_training(device, tp)
    import_torchao("train.float8")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=is_float8_eligible,
                               config=Float8LinearConfig(emulate=emulate))
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())
