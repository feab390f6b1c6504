"""ServerConfig: the request limits of `meshtron serve` (one flag per field, e.g. --max-body-bytes)
and its thread pool. Kept free of heavy imports so the CLI can build its flags; the limits are
enforced in server_limits.py and documented, with their defaults, in docs/serving.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtron.config.fields import ConfigError, option

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


@dataclass(kw_only=True)
class ServerConfig:
    max_body_bytes: int = option(8 * 2**20, "Largest request body in bytes; a larger one is answered 413 before it "
                                            "is parsed (Content-Length, or counted while reading a chunked body)")
    max_prompts: int = option(256, "Most prompts in one /v1/completions request")
    max_n: int = option(16, "Largest n (choices per prompt)")
    max_choices: int = option(256, "Most choices in one request, prompts x n (each is one engine request)")
    max_stop: int = option(16, "Most stop strings in one request")
    max_stop_chars: int = option(256, "Longest stop string, in characters")
    max_stop_token_ids: int = option(64, "Most stop_token_ids in one request")
    max_chars_per_token: int = option(32, "A text prompt (or the messages' text) longer than max_model_len x this "
                                          "many characters is refused before it is tokenized")
    tokenizer_threads: int = option(4, "Threads that parse bodies, render chat templates, tokenize and detokenize "
                                       "echoes, off the event loop")

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{flag_name(f.name)}: {value!r} is not allowed; must be an integer >= 1")


def flag_name(field: str) -> str:
    return field.replace("_", "-")


def add_server_arguments(parser) -> None:
    """One flag per ServerConfig field (--max-body-bytes ...), help and default from the field."""
    group = parser.add_argument_group("request limits and parsing threads (docs/serving.md)")
    for f in dataclasses.fields(ServerConfig):
        group.add_argument("--" + flag_name(f.name), dest=f.name, type=int, default=f.default,
                           help=f"{f.metadata['help']} (default {f.default})")


def server_config_from_args(args) -> ServerConfig:
    cfg = ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
    cfg.validate()
    return cfg
