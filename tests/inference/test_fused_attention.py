"""The fused decode attention (`inference.fused_attention`) against the gather + SDPA path it replaces:
eagerly for grouped-query heads, windows and unequal key/value widths; compiled inside the engine
(slow: inductor compiles for ~15 s), greedy tokens equal to the gather engine's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.inference.fused_attention import paged_decode_attention
from meshtron.inference.varlen_context import AttentionGroup


@pytest.mark.parametrize("heads, kv_heads, dk, dv, window", [(4, 4, 8, 8, None), (8, 2, 16, 16, 5), (4, 1, 12, 8, None)])
def test_matches_gather_and_sdpa(heads, kv_heads, dk, dv, window):
    torch.manual_seed(0)
    num_blocks, bs, rows, blocks = 20, 4, 5, 3
    k_cache, v_cache = torch.randn(num_blocks + 1, bs, kv_heads, dk), torch.randn(num_blocks + 1, bs, kv_heads, dv)
    key_blocks = torch.randperm(num_blocks)[: rows * blocks].view(rows, blocks)
    key_blocks[0, 2] = num_blocks  # a padded block (the scratch block), past the row's position
    positions = torch.tensor([[7], [11], [4], [9], [0]])
    group = AttentionGroup(query_index=torch.arange(rows), key_blocks=key_blocks, query_positions=positions)
    bias = group.bias(bs, window, torch.float32)
    q = torch.randn(rows, heads, 1, dk)
    flat = key_blocks.reshape(-1)
    k, v = (c.index_select(0, flat).view(rows, blocks * bs, kv_heads, -1).transpose(1, 2) for c in (k_cache, v_cache))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3, enable_gqa=heads != kv_heads)
    got = paged_decode_attention(q, k_cache, v_cache, key_blocks, bias, 0.3)
    assert got.shape == (rows, heads, 1, dv)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_decode_attention_in_the_engine_gives_the_same_tokens():
    from meshtron.inference.request import SamplingParams
    from tests.inference.helpers import engine, tiny_model, workload

    model = tiny_model()
    prompts, max_tokens = workload(num_requests=12, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    default = engine(model, num_blocks=128, block_size=4, decode_attention="gather").generate(prompts, params)
    fused = engine(model, num_blocks=128, block_size=4, decode_attention="compiled")
    outs = fused.generate(prompts, params)
    assert fused.runner.decode_attention is not None
    assert [o.token_ids for o in outs] == [o.token_ids for o in default]
