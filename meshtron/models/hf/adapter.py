"""What a Hugging Face model family adapter is, and the registry that picks one.

An adapter maps one family's `config.json` to a `ModelConfig` and back, and lists how its on-disk
tensor names relate to meshtron's parameter names. The relation is a list of `TensorMap`s: one HF
tensor equals the concatenation, along `dim`, of one or more meshtron tensors, optionally stored
transposed (GPT-2's Conv1D keeps weights as (in, out)). Both directions read the same list, so what
imports is exactly what exports.

Families outside meshtron are added without editing it: `register_family(adapter)` in-process, or an
installed distribution declaring an entry point `name = package.module:AdapterClass` (or an adapter
instance) in group `meshtron.hf_families`, imported only when a conversion looks a family up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from meshtron.config.registry import Registry
from meshtron.config.schema import ModelConfig


class ConversionError(ValueError):
    """A model that cannot be converted; the message is one line naming the field, tensor or architecture."""


@dataclass(frozen=True)
class TensorMap:
    hf: str                       # on-disk safetensors name
    parts: tuple[str, ...]        # meshtron state-dict names, concatenated along `dim` to form the HF tensor
    dim: int = 0
    transpose: bool = False       # the HF tensor is stored with its last two dims swapped (GPT-2 Conv1D, GPT-OSS experts)
    interleave: bool = False      # the parts alternate along `dim` (GPT-OSS gate/up rows) instead of following each other
    index: Optional[int] = None   # the HF tensor is entry `index` of the one stacked meshtron part (per-expert files)

    def to_meshtron(self, hf_tensor: torch.Tensor, part_sizes: list[int]) -> list[torch.Tensor]:
        """The meshtron parts (for an indexed map: the part's entry `index`)."""
        t = hf_tensor.transpose(-2, -1) if self.transpose and hf_tensor.dim() >= 2 else hf_tensor
        if len(self.parts) == 1:
            return [t]
        if self.interleave:
            grouped = t.unflatten(self.dim, (-1, len(self.parts)))
            return [grouped.select(self.dim + 1, i) for i in range(len(self.parts))]
        return list(t.split(part_sizes, dim=self.dim))

    def to_hf(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.index is not None:
            parts = [p[self.index] for p in parts]
        if len(parts) == 1:
            t = parts[0]
        elif self.interleave:
            t = torch.stack(parts, dim=self.dim + 1).flatten(self.dim, self.dim + 1)
        else:
            t = torch.cat(parts, dim=self.dim)
        return t.transpose(-2, -1) if self.transpose and t.dim() >= 2 else t

    def hf_shape(self, part_shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        if self.index is not None:
            part_shapes = [s[1:] for s in part_shapes]
        shape = list(part_shapes[0])
        shape[self.dim] = sum(s[self.dim] for s in part_shapes)
        if self.transpose and len(shape) >= 2:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        return tuple(shape)


class FamilyAdapter(Protocol):
    name: str                     # the family as users name it: llama, mistral, qwen2, qwen3, gpt2, mamba2, ...
    architecture: str             # config.json "architectures"[0], e.g. LlamaForCausalLM

    def to_model_config(self, hf: dict[str, Any]) -> ModelConfig: ...

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]: ...

    def tensor_maps(self, cfg: ModelConfig, hf_keys: Optional[set[str]] = None) -> list[TensorMap]: ...

    def ignored(self, hf_name: str) -> bool: ...


# Fields that describe training, not the architecture: `init_from_hf` keeps the user's values.
TRAINING_FIELDS = ("attention_dropout", "hidden_dropout", "init_method_std", "scaled_init", "mtp_num_layers",
                   "mtp_loss_scaling_factor", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                   "moe_input_jitter_eps", "moe_router_bias_update_rate", "moe_expert_capacity_factor",
                   "moe_token_drop_policy", "moe_router_padding_for_quantization", "moe_router_padding_alignment",
                   "moe_grouped_gemm", "moe_router_dtype")


def require(ok: bool, field: str, value: Any, target: str, fix: str) -> None:
    """Raise a one-line ConversionError when a ModelConfig field cannot be expressed in `target`."""
    if not ok:
        raise ConversionError(f"model.{field}={value!r} cannot be written as {target}: {fix}")


def hf_require(ok: bool, key: str, value: Any, family: str, fix: str) -> None:
    """Raise a one-line ConversionError when a config.json key has a value meshtron does not support."""
    if not ok:
        raise ConversionError(f"config.json {key}={value!r} is not supported for {family}: {fix}")


def architecture_of(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if archs:
        return archs[0]
    return str(hf.get("model_type", "<none>"))


FAMILIES = Registry("architecture", "meshtron.hf_families", builtin=(),
                    how_to_add="call meshtron.models.hf.register_family, or declare an entry point")


def check_family_adapter(adapter: Any, name: str) -> None:
    """Raise a one-line TypeError unless `adapter` has what a FamilyAdapter has."""
    missing = [m for m in ("name", "architecture", "to_model_config", "to_hf_config", "tensor_maps", "ignored")
               if not hasattr(adapter, m)]
    if missing:
        raise TypeError(f"family {name!r} ({type(adapter).__qualname__}) lacks {', '.join(missing)}: see "
                        f"meshtron.models.hf.adapter.FamilyAdapter")


def register_family(adapter: FamilyAdapter) -> FamilyAdapter:
    """Make a family adapter (an instance) convertible by its name and architecture; a registered family
    replaces a built-in one of the same name."""
    check_family_adapter(adapter, getattr(adapter, "name", "?"))
    FAMILIES.register(adapter.name, adapter)
    return adapter


def _plugin_families() -> dict[str, FamilyAdapter]:
    found = {}
    for name in FAMILIES.names()[1]:
        def check(obj: Any, n: str) -> None:
            check_family_adapter(obj() if isinstance(obj, type) else obj, n)
        try:
            obj = FAMILIES.load(name, check)
        except ValueError as e:
            raise ConversionError(str(e)) from None
        found[name] = obj() if isinstance(obj, type) else obj
        FAMILIES.register(name, found[name])
    return found


def adapters() -> dict[str, FamilyAdapter]:
    """Every family by name: the built-in ones, then registered ones and entry points (which may replace them)."""
    from meshtron.models.hf.gpt2 import GPT2Adapter
    from meshtron.models.hf.llama import LLAMA_LIKE
    from meshtron.models.hf.mamba2 import Mamba2Adapter
    from meshtron.models.hf.moe_families import MOE_FAMILIES
    from meshtron.models.hf.nemotron_h import NemotronHAdapter

    table: dict[str, FamilyAdapter] = {a.name: a for a in LLAMA_LIKE}
    table["gpt2"] = GPT2Adapter()
    table["mamba2"] = Mamba2Adapter()
    table["nemotron_h"] = NemotronHAdapter()
    table.update({a.name: a for a in MOE_FAMILIES})
    table.update(FAMILIES.registered)
    table.update(_plugin_families())
    return table


def supported_architectures() -> list[str]:
    return [a.architecture for a in adapters().values()]


def adapter_for_hf(hf: dict[str, Any]) -> FamilyAdapter:
    """The adapter of a config.json, by its architecture (or model_type when architectures is absent)."""
    arch = architecture_of(hf)
    for adapter in reversed(adapters().values()):  # a registered family wins over a built-in one
        if arch in (adapter.architecture, adapter.name):
            return adapter
    raise ConversionError(f"architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}")


def adapter_by_name(name: str) -> FamilyAdapter:
    table = adapters()
    for adapter in reversed(table.values()):
        if name in (adapter.name, adapter.architecture):
            return adapter
    raise ConversionError(f"architecture {name!r} is not supported; supported: {', '.join(supported_architectures())}")


def guess_family(cfg: ModelConfig) -> FamilyAdapter:
    """The family whose layout matches a meshtron model trained without a Hugging Face origin."""
    table = adapters()
    if "M" in cfg.pattern:
        return table["mamba2"] if set(cfg.pattern) == {"M"} else table["nemotron_h"]
    if "E" in cfg.pattern:
        if cfg.multi_latent_attention:
            return table["deepseek_v3"]
        if cfg.softmax_type == "learnable":
            return table["gpt_oss"]
        return table["qwen3_moe"] if cfg.qk_layernorm or "-" in cfg.pattern else table["mixtral"]
    if cfg.normalization == "LayerNorm" or cfg.position_embedding_type == "learned_absolute":
        return table["gpt2"]
    if cfg.qk_layernorm:
        return table["qwen3"]
    if cfg.add_qkv_bias and not cfg.add_bias_linear and not cfg.attention_output_bias:
        return table["qwen2"]
    if cfg.window_size is not None:
        mixed = any(not cfg.is_window_layer(i) for i in range(cfg.pattern.count("*")))
        return table["qwen3"] if mixed else table["mistral"]
    return table["llama"]


def with_training_fields(hf_cfg: ModelConfig, user_cfg: ModelConfig) -> ModelConfig:
    """The architecture of `hf_cfg` with the training-only fields of `user_cfg` (init_from_hf)."""
    return dataclasses.replace(hf_cfg, **{f: getattr(user_cfg, f) for f in TRAINING_FIELDS})


def architecture_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Every field that shapes the weights or the forward pass, for comparing two configs."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in TRAINING_FIELDS}


def hf_dtype(hf: dict[str, Any]) -> Optional[torch.dtype]:
    name = hf.get("dtype") or hf.get("torch_dtype")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name or "")
