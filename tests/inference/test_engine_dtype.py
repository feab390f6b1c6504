"""engine.dtype: the served weights, and so the KV cache, take the chosen dtype (auto: bfloat16 on
CUDA, float32 on a CPU); a bfloat16 engine scores like the float32 one within bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from meshtron.config.fields import ConfigError
from meshtron.inference.config import EngineConfig
from meshtron.inference.engine import LLMEngine
from meshtron.inference.request import SamplingParams
from meshtron.training.precision import resolve_engine_dtype
from tests.inference.helpers import save_tiny_checkpoint, workload


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ck"))


def test_auto_is_bfloat16_on_cuda_and_float32_on_a_cpu():
    assert resolve_engine_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_engine_dtype("auto", torch.device("cuda")) == torch.bfloat16   # a device object, no GPU needed
    assert resolve_engine_dtype("float16", torch.device("cpu")) == torch.float16


def test_a_bad_dtype_is_one_line_naming_the_field():
    with pytest.raises(ConfigError) as err:
        EngineConfig(dtype="fp8").validate()
    assert "engine.dtype" in str(err.value) and "bfloat16" in str(err.value) and "\n" not in str(err.value)


def test_bfloat16_engine_builds_a_bfloat16_model_and_cache(checkpoint):
    options = {"kv_cache_memory_mb": 0.25, "block_size": 4, "device": "cpu"}
    fp32 = LLMEngine.from_checkpoint(checkpoint, EngineConfig(**options))   # auto on a CPU: float32
    bf16 = LLMEngine.from_checkpoint(checkpoint, EngineConfig(dtype="bfloat16", **options))
    assert {p.dtype for p in fp32.runner.model.parameters()} == {torch.float32}
    assert {p.dtype for p in bf16.runner.model.parameters()} == {torch.bfloat16}
    assert bf16.config.num_blocks == 2 * fp32.config.num_blocks   # the same memory holds twice the tokens
    prompts = [p for p in workload(num_requests=4, max_prompt=30)[0] if len(p) > 2]
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
    outs = {name: eng.generate(prompts, params) for name, eng in (("fp32", fp32), ("bf16", bf16))}
    for layer_k, layer_v in bf16.runner.cache.layers.values():
        assert layer_k.dtype == layer_v.dtype == torch.bfloat16
    worst = 0.0
    for a, b in zip(outs["fp32"], outs["bf16"]):
        for x, y in zip(a.prompt_log_probs[1:], b.prompt_log_probs[1:]):
            worst = max(worst, abs(x.log_prob - y.log_prob))
        assert len(b.token_ids) == 4
    # bf16 keeps 8 bits of mantissa (relative error 2^-9 per rounding) through 2 layers of a tiny model
    # with large weights (std 0.2): log probs of about -5.5 differed by at most 0.074 when measured
    assert 0 < worst < 0.2
