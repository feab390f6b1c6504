"""Hugging Face interop: config and tensor adapters per family (Llama, Mistral, Qwen2, Qwen3, GPT-2, and
the Mamba families Mamba-2 and NemotronH), streaming safetensors <-> meshtron checkpoint conversion, and `train.init_from_hf`.

Conversion reads and writes safetensors itself (no optional package); `transformers` and `safetensors`
(the `hf` extra) serve the tests as the reference.
"""

from meshtron.models.hf.adapter import (
    ConversionError,
    adapter_by_name,
    adapter_for_hf,
    register_family,
    supported_architectures,
)
from meshtron.models.hf.convert import hf_to_meshtron, meshtron_to_hf
from meshtron.models.hf.init_weights import hf_model_config, init_model_from_hf, load_hf_weights

__all__ = ["ConversionError", "adapter_by_name", "adapter_for_hf", "hf_model_config", "hf_to_meshtron",
           "init_model_from_hf", "load_hf_weights", "meshtron_to_hf", "register_family", "supported_architectures"]
