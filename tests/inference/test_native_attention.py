"""The native decode attention (`inference.native_attention`, a C kernel compiled on first use) against
the eager paged formulation it replaces (itself checked against gather + SDPA in test_fused_attention):
grouped-query heads, windows that start inside a block, unequal key/value widths, rows split over
threads; its index checks, refusals and build cache; and inside the engine, greedy tokens equal to the
default engine's."""

from __future__ import annotations

import pytest
import torch

import meshtron.inference.native_attention as native
from meshtron.config.fields import ConfigError
from meshtron.inference.fused_attention import paged_decode_attention as eager_paged
from meshtron.inference.request import SamplingParams
from meshtron.inference.varlen_context import AttentionGroup
from tests.inference.helpers import engine, tiny_model, workload


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


def test_refusals(monkeypatch):
    with pytest.raises(ConfigError, match="engine.native_decode_attention: .*choose one decode attention"):
        engine(tiny_model(), num_blocks=64, native_decode_attention=True, compile_decode_attention=True)
    with pytest.raises(ConfigError, match="engine.native_decode_attention: .*varlen layout only"):
        engine(tiny_model(), num_blocks=64, native_decode_attention=True, layout="packed")
    with pytest.raises(ConfigError, match="engine.native_decode_attention: true needs float32 weights on the CPU"):
        engine(tiny_model().to(torch.bfloat16), num_blocks=64, native_decode_attention=True)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.raises(ConfigError, match="engine.native_decode_attention: no C compiler found"):
        engine(tiny_model(), num_blocks=64, native_decode_attention=True)


@pytest.mark.parametrize("kind", ["gqa-rope", "window-rope", "mla"])
def test_engine_gives_the_default_engines_tokens(kind):
    model = tiny_model(kind)
    prompts, max_tokens = workload(num_requests=12, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    default = engine(model, num_blocks=128, block_size=4).generate(prompts, params)
    fast = engine(model, num_blocks=128, block_size=4, native_decode_attention=True)
    calls = []
    kernel = fast.runner.decode_attention
    fast.runner.decode_attention = lambda *a: calls.append(1) or kernel(*a)
    outs = fast.generate(prompts, params)
    assert calls  # the decodes went through the kernel
    assert [o.token_ids for o in outs] == [o.token_ids for o in default]
