"""The frozen teacher: its own architecture (width, depth, layer pattern), weights from a meshtron
checkpoint or a Hugging Face directory, sharded like the student.

Architecture, in order of precedence: `teacher.config` (a YAML file whose `model` section is the
teacher's), else the config saved with the meshtron checkpoint, else the HF directory's
config.json. The teacher is built from that config alone, so its layer pattern is its own. It must
share the student's tokenizer (the logits losses compare the same vocabulary).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import yaml

from meshtron.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_config
from meshtron.config.fields import ConfigError
from meshtron.config.loader import config_from_dict
from meshtron.config.schema import ModelConfig, RunConfig
from meshtron.models.gpt import GPTModel


def is_hf_directory(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def teacher_model_config(cfg: RunConfig) -> ModelConfig:
    """The teacher's ModelConfig (read from files only; nothing is built)."""
    t = cfg.teacher
    if t.load is None:
        raise ConfigError("teacher.load: distillation needs a teacher; give a meshtron checkpoint or a Hugging Face "
                          "model directory")
    if not Path(t.load).exists():
        raise ConfigError(f"teacher.load: {t.load!r} does not exist; give a meshtron checkpoint or a HF directory")
    if is_hf_directory(t.load):
        if t.config is not None:
            raise ConfigError("teacher.config: a Hugging Face teacher is described by its config.json; set "
                              "teacher.config to null")
        from meshtron.models.hf import hf_model_config

        return hf_model_config(t.load, ModelConfig())
    if t.config is not None:
        path = Path(t.config)
        if not path.is_file():
            raise ConfigError(f"teacher.config: file {str(path)!r} not found")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise ConfigError(f"teacher.config: {path} has no 'model' section describing the teacher")
        model = config_from_dict({"model": data["model"]}).model
    else:
        try:
            model = config_from_dict(yaml.safe_load(read_checkpoint_config(t.load))).model
        except CheckpointError as e:
            raise ConfigError(f"teacher.load: {e}") from None
    model = dataclasses.replace(model, hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=0)
    model.validate()
    return model


def build_teacher(cfg: RunConfig, model_cfg: ModelConfig, vocab_size: int, device: torch.device) -> GPTModel:
    """The teacher with its weights, frozen and in eval mode, on `device` (not yet sharded)."""
    load = cfg.teacher.load
    if is_hf_directory(load):
        from meshtron.models.hf import load_hf_weights

        model = GPTModel(model_cfg, vocab_size)
        load_hf_weights(model, load)
    else:
        model = GPTModel(model_cfg, vocab_size)
        try:
            load_checkpoint(load, model)
        except CheckpointError as e:
            raise ConfigError(f"teacher.load: {e} (the teacher must use the student's tokenizer and the "
                              "architecture of teacher.config or of its saved config)") from None
    if model.vocab_size < vocab_size:
        raise ConfigError(f"teacher.load: the teacher's vocabulary ({model.vocab_size}) is smaller than the "
                          f"tokenizer's ({vocab_size}); distillation needs the student's tokenizer")
    model.requires_grad_(False)
    return model.to(device).eval()
