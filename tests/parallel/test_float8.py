"""train.float8: refused in one line without a float8 GPU (here: a CPU) and with tensor parallelism;
the conversion (torchao's float8 emulation, which runs on a CPU) swaps every linear but the output
head and the layers whose dims are not multiples of 16, and its forward and backward equal a naive
tensorwise float8 reference written here: each operand scaled by float8 max / amax, rounded to
e4m3 (inputs, weights) or e5m2 (output gradients), multiplied in fp32 and unscaled."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

# found, not imported: importing torchao here would log its extension noise outside meshtron's quieting
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao is not installed (pip install meshtron[quant])")

from meshtron.config import ModelConfig  # noqa: E402
from meshtron.config.fields import ConfigError  # noqa: E402
from meshtron.config.schema import RunConfig  # noqa: E402
from meshtron.models import GPTModel  # noqa: E402
from meshtron.parallel import parallelize_parts  # noqa: E402
from meshtron.parallel.dims import ParallelDims  # noqa: E402
from meshtron.parallel.float8 import apply_float8_training, check_float8_training  # noqa: E402


def fake_float8(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One dynamic scale for the whole tensor: map its amax onto the format's max, round, unscale."""
    top = torch.finfo(dtype).max
    scale = top / t.detach().abs().max().float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-top, top).to(dtype).float() / scale


def tiny_model() -> GPTModel:
    torch.manual_seed(0)
    # ffn 40: the MLP's linears have a dim that is no multiple of 16 and stay in high precision
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=40,
                      max_position_embeddings=32, vocab_size=128, make_vocab_size_divisible_by=1)
    return GPTModel(cfg)


def test_refused_on_a_cpu_in_one_line():
    with pytest.raises(ConfigError) as err:
        check_float8_training(torch.device("cpu"))
    message = str(err.value)
    assert "train.float8" in message and "compute capability >= 8.9" in message and "cpu" in message
    assert "\n" not in message
    # through the trainer's transform step: refused before anything is converted
    cfg = RunConfig()
    cfg.train.float8 = True
    model = tiny_model()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    with pytest.raises(ConfigError, match="train.float8"):
        parallelize_parts([model], dims, None, cfg)
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())


def test_refused_with_tensor_parallelism(monkeypatch):
    monkeypatch.setattr("meshtron.parallel.float8.has_float8", lambda device: True)   # as on an H100
    with pytest.raises(ConfigError, match="train.float8: not combined with tensor parallelism"):
        check_float8_training(torch.device("cuda"), tp=2)


def test_conversion_skips_the_head_and_unaligned_layers():
    model = tiny_model()
    assert apply_float8_training(model, torch.device("cpu"), emulate=True) == 2 * 4   # wq wk wv wo per layer
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("output") == "Linear"
    kept = {name for name, kind in kinds.items() if kind == "Linear"}
    assert kept == {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                    and 40 in (m.in_features, m.out_features)} and len(kept) == 2 * 3   # w_gate, w_up, w_down per layer


def test_emulated_float8_linear_equals_the_naive_reference():
    torch.manual_seed(1)
    layer = torch.nn.Linear(64, 32, bias=True)
    ref = copy.deepcopy(layer)
    wrapper = torch.nn.Sequential(layer)
    apply_float8_training(wrapper, torch.device("cpu"), emulate=True)
    assert type(wrapper[0]).__name__ == "Float8Linear"
    x = torch.randn(6, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn(6, 32)
    y = wrapper(x)
    y.backward(grad_out)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    want = fake_float8(x_ref, e4m3) @ fake_float8(ref.weight, e4m3).T + ref.bias
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)
    assert (y - ref(x_ref)).abs().max() > 1e-3   # float8 really rounded (e4m3 keeps 3 mantissa bits)
    go = fake_float8(grad_out, e5m2)
    torch.testing.assert_close(x.grad, go @ fake_float8(ref.weight.detach(), e4m3), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(layer.weight.grad, go.T @ fake_float8(x_ref.detach(), e4m3), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(layer.bias.grad, grad_out.sum(0))


def test_emulated_float8_model_logits_equal_naive_float8_linears():
    model = tiny_model()
    naive = copy.deepcopy(model)
    apply_float8_training(model, torch.device("cpu"), emulate=True)
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    for name, m in naive.named_modules():
        if name in converted:
            m.forward = (lambda lin: lambda x: torch.nn.functional.linear(
                fake_float8(x, torch.float8_e4m3fn), fake_float8(lin.weight, torch.float8_e4m3fn), lin.bias))(m)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), naive(tokens), atol=1e-5, rtol=1e-5)
