"""engine.decode_attention: the default (auto) engine on a CPU decodes with the native kernel, falls
back to gather + SDPA with one log line naming the reason when the kernel cannot serve (no compiler,
non-float32 weights, CUDA), and keeps greedy tokens equal to full recompute either way; forced
choices, other layouts, and the replaced boolean options and flags (one line naming the new one)."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

import meshtron.inference.decode_attention as selection
import meshtron.inference.native_attention as native
from meshtron.config.fields import ConfigError
from meshtron.inference.config import EngineConfig, add_engine_arguments
from meshtron.inference.fused_attention import compiled_decode_attention
from tests.inference.helpers import engine, greedy_params, reference_greedy, tiny_model, workload


@pytest.fixture
def fresh_notices(monkeypatch):
    monkeypatch.setattr(selection, "_noticed", set())


def test_the_default_engine_on_a_cpu_uses_the_native_kernel(fresh_notices, caplog):
    caplog.set_level(logging.INFO, logger="meshtron.engine")
    model = tiny_model()
    first = engine(model, num_blocks=64)
    engine(model, num_blocks=64)
    assert first.config.decode_attention == "auto"
    assert first.runner.decode_attention_choice == "native"
    assert first.runner.decode_attention is native.native_decode_attention
    notices = [r.getMessage() for r in caplog.records if "decode_attention" in r.getMessage()]
    assert notices == ["engine.decode_attention auto: native (the C kernel; CPU, float32)"]  # once per process


def test_without_a_compiler_auto_falls_back_to_gather_with_one_warning(fresh_notices, monkeypatch, caplog):
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    model = tiny_model()
    prompts, max_tokens = workload(num_requests=6, seed=5)
    with caplog.at_level(logging.INFO, logger="meshtron.engine"):
        eng = engine(model, num_blocks=128, block_size=4)
        engine(model, num_blocks=128, block_size=4)
    assert eng.runner.decode_attention_choice == "gather" and eng.runner.decode_attention is None
    (record,) = [r for r in caplog.records if "decode_attention" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == ("engine.decode_attention auto: gather + SDPA, because the native kernel cannot be "
                                   "built: no C compiler found (set $CC, or install cc, gcc or clang)")
    outs = eng.generate(prompts, greedy_params(max_tokens))
    assert [o.token_ids for o in outs] == [reference_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]


def test_auto_keeps_gather_where_the_kernel_does_not_apply(fresh_notices, caplog):
    caplog.set_level(logging.INFO, logger="meshtron.engine")
    model = tiny_model()
    bf16 = engine(tiny_model().to(torch.bfloat16), num_blocks=64)
    assert bf16.runner.decode_attention is None
    cuda_choice, cuda = selection.select_decode_attention(model, EngineConfig(), torch.device("cuda"))  # no op yet
    assert cuda_choice == "flex" and cuda.compiled  # the paged FlexAttention kernel, not the native one
    assert engine(model, num_blocks=64, layout="packed").runner.decode_attention is None  # no decode buckets
    messages = {r.getMessage(): r.levelno for r in caplog.records}
    assert messages == {
        "engine.decode_attention auto: gather + SDPA, because the native kernel needs float32 weights (the model "
        "is bfloat16)": logging.WARNING,
        "engine.decode_attention auto: flex (compiled FlexAttention reading the paged cache)": logging.INFO}


def test_forced_choices():
    model = tiny_model()
    assert engine(model, num_blocks=64, decode_attention="gather").runner.decode_attention is None
    compiled = engine(model, num_blocks=64, decode_attention="compiled").runner  # compiles on the first decode
    assert (compiled.decode_attention_choice, compiled.decode_attention) == ("compiled", compiled_decode_attention)
    forced = engine(model, num_blocks=64, decode_attention="native").runner
    assert forced.decode_attention is native.native_decode_attention
    with pytest.raises(ConfigError, match=r"engine.decode_attention: 'fast' is not allowed; choose one of \('auto'"):
        engine(model, num_blocks=64, decode_attention="fast")


@pytest.mark.parametrize("name, choice", [("native_decode_attention", "native"),
                                          ("compile_decode_attention", "compiled")])
def test_the_replaced_booleans_name_their_replacement(name, choice, capsys):
    with pytest.raises(ConfigError, match=f"engine.{name} was replaced by engine.decode_attention: set "
                                          f"decode_attention='{choice}'"):
        EngineConfig(**{name: True})
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flag = "--" + name.replace("_", "-")
    for given, replacement in ((flag, choice), ("--no-" + flag[2:], "gather")):
        with pytest.raises(SystemExit):
            parser.parse_args([given])
        assert f"{given} was replaced by --decode-attention {replacement}" in capsys.readouterr().err
    assert flag not in parser.format_help()
    assert parser.parse_args(["--decode-attention", "gather"]).decode_attention == "gather"
