"""The native decode attention (`inference.native_attention`, a C kernel compiled on first use) against
the eager paged formulation it replaces (itself checked against gather + SDPA in test_fused_attention):
grouped-query heads, windows that start inside a block, unequal key/value widths, rows split over
threads; its index checks, refusals, build cache (also with concurrent first builds) and build
failures; and inside the engine, greedy tokens equal to the gather engine's and to full recompute."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import meshtron.inference.native_attention as native
from meshtron.config.fields import ConfigError
from meshtron.inference.fused_attention import paged_decode_attention as eager_paged
from meshtron.inference.request import SamplingParams
from meshtron.inference.varlen_context import AttentionGroup
from tests.inference.helpers import engine, reference_greedy, tiny_model, workload

ROOT = Path(__file__).resolve().parents[2]


def case(heads: int, kv_heads: int, dk: int, dv: int, rows: int = 6, blocks: int = 4, bs: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = rows * blocks + 3
    k_cache = torch.randn(num_blocks + 1, bs, kv_heads, dk, generator=g)
    v_cache = torch.randn(num_blocks + 1, bs, kv_heads, dv, generator=g)
    key_blocks = torch.randperm(num_blocks, generator=g)[: rows * blocks].view(rows, blocks)
    positions = torch.randint(0, blocks * bs, (rows, 1), generator=g)
    positions[0, 0] = 0  # a one-key context
    key_blocks[1, -1] = num_blocks  # a padded block (the scratch block) past the row's end
    positions[1, 0] = min(int(positions[1, 0]), (blocks - 1) * bs - 1)
    q = torch.randn(rows, heads, 1, dk, generator=g)
    return q, k_cache, v_cache, AttentionGroup(query_index=torch.arange(rows), key_blocks=key_blocks,
                                               query_positions=positions)


@pytest.mark.parametrize("heads, kv_heads, dk, dv, window", [(4, 4, 8, 8, None), (8, 2, 16, 16, 5), (4, 1, 12, 8, None),
                                                             (6, 3, 8, 4, 3)])
def test_matches_the_eager_paged_formulation(heads, kv_heads, dk, dv, window):
    q, k_cache, v_cache, group = case(heads, kv_heads, dk, dv)
    expected = eager_paged(q, k_cache, v_cache, group.key_blocks, group.bias(4, window, torch.float32), 0.3)
    got = native.native_decode_attention(q, k_cache, v_cache, group, window, 0.3)
    assert got.shape == (q.shape[0], heads, 1, dv)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_rows_split_over_threads_give_the_same_result():
    q, k_cache, v_cache, group = case(8, 2, 16, 16, rows=37, blocks=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.native_decode_attention(q, k_cache, v_cache, group, None, 0.25)
        torch.set_num_threads(4)  # more threads than cores is fine: each takes a slice of rows
        four = native.native_decode_attention(q, k_cache, v_cache, group, None, 0.25)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)


def test_an_empty_key_range_gives_zeros_and_bad_indices_are_refused():
    q, k_cache, v_cache, group = case(4, 4, 8, 8, rows=2)
    out = native.paged_decode_attention(q[:, :, 0], k_cache, v_cache, group.key_blocks, torch.tensor([3, 0]),
                                        torch.tensor([2, 0]), 1.0)
    assert torch.equal(out[0], torch.zeros(4, 8)) and out[1].abs().sum() > 0
    bs, width = k_cache.shape[1], group.key_blocks.shape[1]
    with pytest.raises(ValueError, match="out of range"):  # a position past the block table
        native.paged_decode_attention(q[:, :, 0], k_cache, v_cache, group.key_blocks, torch.tensor([0, 0]),
                                      torch.tensor([0, bs * width]), 1.0)
    bad_blocks = group.key_blocks.clone()
    bad_blocks[0, 0] = k_cache.shape[0]  # a block id past the cache
    with pytest.raises(ValueError, match="out of range"):
        native.paged_decode_attention(q[:, :, 0], k_cache, v_cache, bad_blocks, torch.tensor([0, 0]),
                                      torch.tensor([1, 1]), 1.0)
    with pytest.raises(ValueError, match="float32 on the CPU"):
        native.paged_decode_attention(q[:, :, 0].double(), k_cache, v_cache, group.key_blocks, torch.tensor([0, 0]),
                                      torch.tensor([1, 1]), 1.0)


def test_builds_into_the_cache_dir_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_library", None)
    native.load_library()
    (built,) = (tmp_path / "kernels").glob("paged_attention-*.so")
    stamp = built.stat().st_mtime_ns
    monkeypatch.setattr(native, "_library", None)
    native.load_library()  # a second process finds the file and does not rebuild it
    assert built.stat().st_mtime_ns == stamp and len(list((tmp_path / "kernels").iterdir())) == 1


BUILD_AND_CHECK = """
import torch
from meshtron.inference.native_attention import load_library, paged_decode_attention
load_library()
q, k, v = torch.ones(1, 2, 4), torch.zeros(3, 4, 2, 4), torch.randn(3, 4, 2, 4)
out = paged_decode_attention(q, k, v, torch.tensor([[2]]), torch.tensor([0]), torch.tensor([1]), 1.0)
torch.testing.assert_close(out, v[2, :2].mean(0)[None])  # equal scores: the mean of the two values
"""


def test_concurrent_first_builds_each_load_a_whole_library(tmp_path):
    """Every engine test builds the kernel on a fresh machine: processes that start together each
    compile to a temporary file and rename it into place, so none loads a half-written file."""
    env = {**os.environ, "MESHTRON_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_AND_CHECK], env=env, cwd=ROOT, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert [f.suffix for f in (tmp_path / "kernels").iterdir()] == [".so"]  # one library, no temporary left


def test_refusals(monkeypatch):
    with pytest.raises(ConfigError, match="engine.decode_attention: 'native' is not allowed; .*varlen layout only"):
        engine(tiny_model(), num_blocks=64, decode_attention="native", layout="packed")
    with pytest.raises(ConfigError, match="engine.decode_attention: 'native' is not available: the native kernel "
                                          "needs float32 weights"):
        engine(tiny_model().to(torch.bfloat16), num_blocks=64, decode_attention="native")
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.raises(ConfigError, match="engine.decode_attention: 'native' is not available: .*no C compiler found"):
        engine(tiny_model(), num_blocks=64, decode_attention="native")


def test_a_failed_build_is_named_and_not_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_failure", None)
    monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, "-fno-such-flag"])
    with pytest.raises(native.KernelBuildError, match="compiling paged_attention.c with .* failed: .*no-such-flag"):
        native.load_library()
    monkeypatch.setattr(native, "_build", lambda *a: pytest.fail("a failed build is tried once per process"))
    with pytest.raises(native.KernelBuildError, match="failed"):
        native.load_library()
    assert list((tmp_path / "kernels").iterdir()) == []  # the temporary build directory is gone


@pytest.mark.parametrize("kind", ["gqa-rope", "window-rope", "mla", "window-sinks-learned-pos"])
def test_engine_tokens_equal_the_gather_engines_and_full_recompute(kind):
    model = tiny_model(kind)
    prompts, max_tokens = workload(num_requests=12, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    gather = engine(model, num_blocks=128, block_size=4, decode_attention="gather")
    assert gather.runner.decode_attention is None
    expected = [o.token_ids for o in gather.generate(prompts, params)]
    fast = engine(model, num_blocks=128, block_size=4)  # the default: native here
    calls = []
    kernel = fast.runner.decode_attention
    if kind == "window-sinks-learned-pos":  # every layer has sinks, which the kernel lacks: gather
        assert kernel is None and fast.runner.decode_attention_choice == "gather"
    else:
        fast.runner.decode_attention = lambda *a: calls.append(1) or kernel(*a)
    outs = fast.generate(prompts, params)
    assert bool(calls) == (kernel is not None)  # the decodes went through the kernel
    assert [o.token_ids for o in outs] == expected
    assert expected[:4] == [reference_greedy(model, p, n, eos=-1) for p, n in zip(prompts[:4], max_tokens[:4])]
