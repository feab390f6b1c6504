"""Build the train/valid/test datasets a run's config asks for."""

from __future__ import annotations

from meshtron.config.fields import ConfigError
from meshtron.config.schema import RunConfig
from meshtron.data.stream import build_stream_datasets
from meshtron.data.tokenizer import Tokenizer


def build_datasets(cfg: RunConfig, tokenizer: Tokenizer):
    """Returns [train, valid, test]; an empty `data.paths` reads the embedded stdlib corpus raw."""
    if not cfg.data.paths:
        return build_stream_datasets(cfg.data, tokenizer)
    raise ConfigError("data.paths: indexed datasets need `meshtron preprocess` (data pipeline); "
                      "leave data.paths empty to use the embedded corpus")
