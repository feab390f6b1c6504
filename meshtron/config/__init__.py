"""Typed configuration: dataclasses for every knob, with the YAML loader and CLI generated from them."""

from meshtron.config.fields import ConfigError
from meshtron.config.loader import config_from_dict, config_to_dict, load_config, save_config
from meshtron.config.schema import (
    CheckpointConfig,
    DataConfig,
    EnvConfig,
    LoggerConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RLConfig,
    RunConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "EnvConfig", "LoggerConfig", "ModelConfig", "OptimizerConfig",
    "ParallelConfig", "RLConfig", "RunConfig", "SchedulerConfig", "TokenizerConfig", "TrainConfig",
    "config_from_dict", "config_to_dict", "load_config", "save_config",
]
