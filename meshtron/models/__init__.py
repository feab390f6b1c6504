"""Models built from a layer pattern, and (later) Hugging Face converters under models/hf/."""

from meshtron.models.gpt import GPTModel, count_parameters, flops_per_token

__all__ = ["GPTModel", "count_parameters", "flops_per_token"]
