"""engine.quantize: torchao's quantized weights. int8 logits equal an fp32 model holding the weights
dequantized by hand (int8 x per-row scale, the scale from its closed form) and stay near the fp32
model; the engine's greedy tokens with --quantize equal a plain full-recompute loop over the same
quantized model; int4 runs on a CPU; the flag parses; float8 on a CPU, a bad mode and a
tensor-parallel model are refused in one line."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys

import pytest
import torch

# found, not imported: importing torchao here would log its extension noise outside meshtron's quieting
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao is not installed (pip install meshtron[quant])")

from meshtron.cli import build_parser  # noqa: E402
from meshtron.config import ModelConfig  # noqa: E402
from meshtron.config.fields import ConfigError  # noqa: E402
from meshtron.inference.config import EngineConfig, engine_config_from_args  # noqa: E402
from meshtron.inference.engine import LLMEngine  # noqa: E402
from meshtron.inference.quantize import quantize_model  # noqa: E402
from meshtron.models import GPTModel  # noqa: E402
from meshtron.testing.multiprocess import run_ranks  # noqa: E402
from tests.inference.helpers import (  # noqa: E402
    TOKENIZER,
    greedy_params,
    reference_greedy,
    save_tiny_checkpoint,
    workload,
)

ENGINE = dict(num_blocks=64, block_size=4, max_num_batched_tokens=32, device="cpu")


def model_128(seed: int = 0) -> GPTModel:
    """Linear layers with 128 or 256 input features (int4 quantizes in groups of 128), untied head."""
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
                      max_position_embeddings=64, make_vocab_size_divisible_by=1, position_embedding_type="rope")
    return GPTModel(cfg, TOKENIZER.vocab_size).eval()


def linears(model):
    return {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}


@torch.no_grad()
def test_int8_logits_equal_the_hand_dequantized_fp32_model():
    fp32 = model_128()
    quant = quantize_model(copy.deepcopy(fp32), "int8-weight-only")
    naive = copy.deepcopy(fp32)
    ref_linears, naive_linears = linears(fp32), linears(naive)
    assert set(linears(quant)) == set(ref_linears) and "output" in ref_linears   # every linear, the head too
    for name, layer in linears(quant).items():
        w = ref_linears[name].weight
        qdata, scale = layer.weight.qdata, layer.weight.scale.reshape(-1, 1)
        assert qdata.dtype == torch.int8
        # symmetric per output row: the scale maps the row's largest magnitude onto 127.5 steps
        torch.testing.assert_close(scale, w.abs().amax(dim=1, keepdim=True) / 127.5)
        dequantized = qdata.float() * scale
        assert ((dequantized - w).abs() <= scale / 2 + 1e-7).all()   # round to nearest
        naive_linears[name].weight.copy_(dequantized)
    assert type(quant.embedding.weight) is torch.nn.Parameter   # embeddings stay in the model's dtype
    tokens = torch.randint(0, TOKENIZER.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    got, want, exact = quant(tokens), naive(tokens), fp32(tokens)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # against fp32: each weight moves by <= scale/2 (~0.4% of its row's max); the logits move by
    # about 1e-3 on logits of std ~1 here (measured 2.3e-3 at most)
    assert 0 < (got - exact).abs().max() < 2e-2


@torch.no_grad()
def test_int4_on_a_cpu_stays_near_fp32():
    fp32 = model_128()
    quant = quantize_model(copy.deepcopy(fp32), "int4-weight-only")
    kinds = {name: type(m.weight).__name__ for name, m in linears(quant).items()}
    # the 257-row head of the byte vocabulary is no multiple of 16 output features: kept in fp32
    assert kinds.pop("output") == "Parameter" and set(kinds.values()) == {"Int4OpaqueTensor"}
    eye = torch.eye(128)
    for name, layer in linears(quant).items():
        if layer.in_features != 128 or name == "output":
            continue
        # the packed weights are opaque: read them back by multiplying the identity
        dequantized = layer(eye).T
        w = linears(fp32)[name].weight.reshape(layer.out_features, -1, 128)
        step = (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / 15   # 16 levels per group of 128
        err = (dequantized.reshape_as(w) - w).abs()
        assert (err <= step / 2 * 1.01 + 1e-6).all()
    tokens = torch.randint(0, TOKENIZER.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    assert 0 < (quant(tokens) - fp32(tokens)).abs().max() < 0.3


@pytest.mark.parametrize("mode", ["int8-weight-only", "int4-weight-only"])
def test_engine_greedy_equals_a_plain_loop_over_the_quantized_model(mode):
    model = model_128()
    engine = LLMEngine(model, TOKENIZER, EngineConfig(quantize=mode, **ENGINE))
    assert engine.runner.model is model and model.quantization == mode   # quantized in place, before the cache
    prompts, max_tokens = workload(num_requests=4, max_prompt=20, max_output=8)
    outs = engine.generate(prompts, greedy_params(max_tokens))
    for out, prompt, n in zip(outs, prompts, max_tokens):
        assert list(out.token_ids) == reference_greedy(model, prompt, n)


def test_from_checkpoint_quantizes_after_loading(tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "ck")
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(quantize="int8-weight-only", **ENGINE))
    model = engine.runner.model
    assert {type(m.weight).__name__ for m in linears(model).values()} == {"Int8Tensor"}
    out = engine.generate([[5, 6, 7]], greedy_params([4]))[0]
    assert list(out.token_ids) == reference_greedy(model, [5, 6, 7], 4)


def test_the_flag_parses_and_a_bad_mode_names_the_field():
    args = build_parser().parse_args(["serve", "--checkpoint", "ck", "--quantize", "int8-weight-only"])
    assert engine_config_from_args(args).quantize == "int8-weight-only"
    args = build_parser().parse_args(["generate", "--checkpoint", "ck", "--quantize", "int4-weight-only"])
    assert engine_config_from_args(args, skip=("seed",)).quantize == "int4-weight-only"
    with pytest.raises(ConfigError) as err:
        EngineConfig(quantize="int3").validate()
    assert "engine.quantize" in str(err.value) and "int8-weight-only" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["float8-weight-only", "float8-dynamic"])
def test_float8_is_refused_on_a_cpu_in_one_line(mode):
    model = model_128()
    with pytest.raises(ConfigError) as err:
        LLMEngine(model, TOKENIZER, EngineConfig(quantize=mode, **ENGINE))
    message = str(err.value)
    assert "engine.quantize" in message and "compute capability >= 8.9" in message and "cpu" in message
    assert "\n" not in message
    assert type(model.output.weight) is torch.nn.Parameter   # nothing was changed


def test_the_command_line_refuses_float8_on_a_cpu_in_one_line(tmp_path, capsys):
    from meshtron.cli import main

    checkpoint = save_tiny_checkpoint(tmp_path / "ck")
    rc = main(["generate", "--checkpoint", checkpoint, "--prompt", "ab", "--device", "cpu",
               "--quantize", "float8-weight-only"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: engine.quantize: float8-weight-only needs a CUDA GPU")
    assert err.count("\n") == 1   # one line, no traceback


def test_importing_torchao_prints_nothing():
    code = ("import torch; from meshtron.inference.quantize import quantize_model; "
            "quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 8)), 'int8-weight-only', 'cpu')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


def tp_rank(rank: int, world_size: int, checkpoint: str):
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtron.testing.multiprocess import rank_backend, rank_device_type

    torch.set_num_threads(1)
    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=60))
    mesh = init_device_mesh(rank_device_type(), (world_size,), mesh_dim_names=("tp",))
    try:
        LLMEngine.from_checkpoint(checkpoint, EngineConfig(quantize="int8-weight-only", **ENGINE), tp_mesh=mesh)
    except ConfigError as e:
        return str(e)
    return "not refused"


def test_tensor_parallel_quantize_is_refused_in_one_line(tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "ck")
    for message in run_ranks("tests.inference.test_quantize:tp_rank", 2, timeout_s=120, checkpoint=checkpoint):
        assert "engine.quantize" in message and "tensor-parallel" in message and "\n" not in message
