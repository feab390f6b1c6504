"""Shared test settings: no model hub, single-threaded torch for repeatable timings, and a helper
that builds a tiny run config."""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402


def pytest_configure(config):
    import torch

    config.torch_safe_globals = list(torch.serialization.get_safe_globals())


@pytest.fixture(autouse=True)
def torch_weights_only_allowlist(request):
    """Each test sees torch's own weights_only allowlist. Importing megatron-core (the Megatron interop
    tests' reference, imported while collecting) adds numpy arrays, argparse.Namespace, PosixPath and its
    own classes to it for the whole process, so meshtron's refusals of pickled objects would pass
    unnoticed in later tests. The megatron tests keep megatron-core's additions (its loads need them)."""
    import torch

    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(request.config.torch_safe_globals)
    megatron = sys.modules.get("megatron.core.safe_globals")
    if megatron is not None and "megatron" in request.node.nodeid:
        megatron.register_safe_globals()
    yield

TINY = {
    "model.num_layers": "2",
    "model.hidden_size": "32",
    "model.num_attention_heads": "4",
    "model.num_query_groups": "2",
    "model.ffn_hidden_size": "64",
    "model.max_position_embeddings": "64",
    "data.seq_length": "32",
    "train.micro_batch_size": "2",
    "train.global_batch_size": "4",
    "train.train_iters": "4",
    "train.eval_interval": "0",
    "train.peak_flops": "1e11",
    "logger.progress_bar": "off",
    "logger.log_interval": "1",
    "scheduler.warmup_steps": "2",
}


@pytest.fixture
def tiny_config(tmp_path):
    """tiny_config(**{'section.field': 'value'}) -> validated RunConfig writing under tmp_path."""
    from meshtron.config import load_config

    def make(**overrides: str):
        values = {**TINY, "train.run_dir": str(tmp_path / "run"), **{k: str(v) for k, v in overrides.items()}}
        return load_config(overrides=values)

    return make
