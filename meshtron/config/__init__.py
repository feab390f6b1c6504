"""Typed configuration: dataclasses for every knob, with the YAML loader and CLI generated from them."""

from meshtron.config.fields import ConfigError
from meshtron.config.loader import config_from_dict, config_to_dict, load_config, save_config
from meshtron.config.schema import (
    CheckpointConfig,
    DataConfig,
    DistillConfig,
    EnvConfig,
    GradsConfig,
    LoggerConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ProfileConfig,
    RLConfig,
    RunConfig,
    SchedulerConfig,
    TeacherConfig,
    TokenizerConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "DistillConfig", "EnvConfig", "GradsConfig", "LoggerConfig",
    "ModelConfig", "OptimizerConfig", "ParallelConfig", "ProfileConfig", "RLConfig", "RunConfig", "SchedulerConfig",
    "TeacherConfig", "TokenizerConfig", "TrainConfig",
    "config_from_dict", "config_to_dict", "load_config", "save_config",
]
