"""`train.init_from_hf`: build the model a Hugging Face directory describes and copy its weights in.

The architecture comes from config.json; the training-only fields (dropout, init, MTP) come from the
user's model section. Weights are copied tensor by tensor, each read from its safetensors file with a
positioned read of just that tensor's bytes. Parameters with no HF counterpart (new MTP depths) keep
their fresh initialisation. Conversion errors (unsupported architecture, missing or unexpected tensor,
unreadable file) reach the user as one-line ConfigErrors naming `train.init_from_hf`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshtron.config.fields import ConfigError
from meshtron.config.schema import ModelConfig
from meshtron.models.gpt import GPTModel
from meshtron.models.hf.adapter import ConversionError, adapter_for_hf, with_training_fields
from meshtron.models.hf.convert import check_hf_tensors, read_hf_config
from meshtron.models.hf.safetensors_io import SafetensorsDir, SafetensorsError


def hf_model_config(hf_dir: str | Path, user_cfg: ModelConfig) -> ModelConfig:
    hf = read_hf_config(hf_dir)
    cfg = with_training_fields(adapter_for_hf(hf).to_model_config(hf), user_cfg)
    cfg.validate()
    return cfg


@torch.no_grad()
def load_hf_weights(model: GPTModel, hf_dir: str | Path) -> list[str]:
    """Copy the HF weights into `model` (built from the same architecture); return the names left untouched."""
    hf = read_hf_config(hf_dir)
    adapter = adapter_for_hf(hf)
    view = SafetensorsDir(hf_dir)
    maps = adapter.tensor_maps(model.cfg, set(view.keys()))
    params = model.state_dict()
    shapes = {name: tuple(t.shape) for name, t in params.items()}
    check_hf_tensors(maps, view, shapes, adapter)
    covered: set[str] = set()
    for m in maps:
        pieces = m.to_meshtron(view.get(m.hf), [shapes[p][m.dim] for p in m.parts])
        for name, piece in zip(m.parts, pieces):
            (params[name] if m.index is None else params[name][m.index]).copy_(piece)
            covered.add(name)
    untouched = [n for n in params if n not in covered]
    foreign = [n for n in untouched if not n.startswith("mtp.")]
    if foreign:
        raise ConversionError(f"{str(hf_dir)!r} has no weight for {foreign[0]!r} ({len(foreign)} in all)")
    return untouched


def init_model_from_hf(hf_dir: str | Path, user_cfg: ModelConfig, tokenizer_vocab_size: int,
                       device: torch.device, seq_length: int = 1) -> tuple[ModelConfig, GPTModel]:
    """(model config, model with the HF weights) for `train.init_from_hf`."""
    try:
        cfg = hf_model_config(hf_dir, user_cfg)
    except (ConversionError, SafetensorsError) as e:
        raise ConfigError(f"train.init_from_hf: {e}") from None
    if seq_length > cfg.max_position_embeddings:
        raise ConfigError(f"data.seq_length: {seq_length} is not allowed; must be <= the max_position_embeddings "
                          f"{cfg.max_position_embeddings} of {hf_dir}")
    if tokenizer_vocab_size > cfg.vocab_size:
        raise ConfigError(f"train.init_from_hf: the tokenizer has {tokenizer_vocab_size} ids but {hf_dir} has "
                          f"{cfg.vocab_size}; set tokenizer.type hf and tokenizer.path to the model's tokenizer")
    model = GPTModel(cfg, tokenizer_vocab_size)
    try:
        load_hf_weights(model, hf_dir)
    except (ConversionError, SafetensorsError) as e:
        raise ConfigError(f"train.init_from_hf: {e}") from None
    return cfg, model.to(device)
