"""Host syncs of a MoE sublayer (issue 18, findings 3 and 8) and its grouped GEMM in every dtype it takes.

On CPU nothing waits at a host read, so reads are counted where they would block a GPU: the Python-level
reads (Tensor.item/.tolist/.cpu/.numpy, int()/float()/bool()/index()) and, through a dispatch mode,
the operators whose output size depends on tensor values (nonzero, masked_select, unique, bincount,
boolean indexing, repeat_interleave without output_size, _local_scalar_dense). A MoE forward + backward
with the local dispatcher and grouped experts makes none (it made three: nonzero, masked_select, and the
experts' counts whenever the weights were not bf16); the looped experts (fp64, moe_grouped_gemm false)
make one. Numerics: bf16 and fp32 layers against the float64 per-token loop, grouped against looped."""

from __future__ import annotations

import pytest
import torch

from meshtron.nn.moe import GroupedExperts
from meshtron.nn.moe.dispatcher import permute, unpermute
from meshtron.nn.moe.routing_map import RowBound, build_routing_map
from meshtron.testing.host_reads import count_host_reads
from tests.nn import moe_reference as ref
from tests.nn.test_moe import make_cfg, make_layer


def step_reads(layer, x: torch.Tensor) -> list[str]:
    """Host reads of one forward + backward of `layer` (a warm-up call first)."""
    layer(x).sum().backward()
    with count_host_reads() as log:
        layer(x).square().sum().backward()
    return log


VARIANTS = {
    "dropless": dict(),
    "capacity_probs": dict(moe_expert_capacity_factor=0.6),
    "capacity_position": dict(moe_expert_capacity_factor=0.6, moe_token_drop_policy="position"),
    "padding_shared_bias": dict(moe_router_padding_for_quantization=True, moe_router_padding_alignment=4,
                                moe_shared_expert_intermediate_size=8, add_bias_linear=True, moe_router_topk=3),
    "gptoss_glu_bias": dict(activation="quick_geglu", activation_func_clamp_value=0.3, glu_linear_offset=1.0,
                            add_bias_linear=True, moe_router_add_bias=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_moe_forward_backward_reads_nothing_on_the_host(variant, dtype):
    layer = make_layer(make_cfg(**VARIANTS[variant])).to(dtype)
    x = torch.randn(2, 8, 16, dtype=dtype, requires_grad=True)
    assert step_reads(layer, x) == []


@pytest.mark.parametrize("kw", [dict(moe_grouped_gemm=False), dict()], ids=["looped", "fp64"])
def test_looped_experts_read_their_counts_once(kw):
    layer = make_layer(make_cfg(**kw))
    dtype = torch.float32 if kw else torch.float64
    reads = step_reads(layer.to(dtype), torch.randn(2, 8, 16, dtype=dtype, requires_grad=True))
    assert len(reads) == 1 and reads[0].startswith("tolist at nn/moe/experts.py"), reads


def test_the_counter_sees_the_old_dispatch():
    """The counter is not blind: the dispatch this issue replaced (nonzero + masked_select) is two reads."""
    routing_map = torch.rand(6, 4) > 0.5
    with count_host_reads() as log:
        routing_map.t().nonzero(as_tuple=True)
        torch.rand(4, 6).masked_select(routing_map.t())
        torch.rand(3)[torch.tensor([True, False, True])]
    assert len(log) == 3, log


@pytest.mark.parametrize("variant", ["dropless", "capacity_probs", "padding_shared_bias", "gptoss_glu_bias"])
def test_bf16_layer_matches_the_per_token_loop(variant):
    """bf16 weights and tokens: the layer (grouped GEMMs) against the float64 loop over the same bf16
    values, within bf16 rounding; and grouped against looped experts, forward and backward."""
    cfg = make_cfg(**VARIANTS[variant])
    layer = make_layer(cfg).to(torch.bfloat16)
    x = torch.randn(2, 8, 16).to(torch.bfloat16)
    expected = ref.moe_layer_reference(layer, x.double(), cfg)
    got = layer(x).double()
    assert (got - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
    results = []
    for grouped in (True, False):
        layer.experts.grouped = grouped
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append([y.float(), xi.grad.float(), layer.experts.w_up.grad.float(), layer.router.weight.grad.float()])
    for a, b in zip(*results):
        assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item()


def test_permute_with_a_row_bound_and_aligned_groups():
    """Fixed-size rows (spare rows at the end) and groups starting at multiples of 8 rows (CUDA's alignment
    for bf16) give the exact permutation's output and gradients; the group sizes are the counts rounded up."""
    cfg = make_cfg(moe_expert_capacity_factor=0.6)
    layer = make_layer(cfg)
    tokens = torch.randn(16, 16)
    probs, indices, _ = layer.router(tokens.view(2, 8, 16))
    routing = build_routing_map(probs, indices, 8, 0.6)
    counts = routing.routing_map.sum(0)
    results = []
    for max_rows, align in ((None, 1), (RowBound(2, 8, 0.6)(16), 1), (RowBound(2, 8, 0.6)(16), 8)):
        t, p = tokens.clone().requires_grad_(), routing.probs.detach().clone().requires_grad_()
        rows, sizes, handle = permute(t, p, routing.routing_map, max_rows, align)
        assert torch.equal(sizes, (counts + align - 1) // align * align)
        assert rows.shape[0] == (int(counts.sum()) if max_rows is None else max_rows + 8 * (align - 1))
        y = unpermute(layer.experts(rows, sizes), handle)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y.detach(), t.grad, p.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_experts_run_spare_rows_through_the_last_expert():
    torch.manual_seed(0)
    experts = GroupedExperts(3, 16, 32, "swiglu", bias=True)
    experts.init_weights(0.2, 0.2)
    x = torch.randn(9, 16)
    counts = torch.tensor([2, 0, 4])  # 3 spare rows
    grouped = experts(x, counts)
    experts.grouped = False
    looped = experts(x, counts)
    full = experts(x, [2, 0, 7])
    torch.testing.assert_close(grouped, full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(looped, full, atol=1e-6, rtol=1e-5)


def test_grouped_gemm_is_used_for_every_dtype_it_takes():
    from meshtron.compat import grouped_mm_reads_offsets, grouped_mm_row_alignment, grouped_mm_supported

    w = torch.zeros(4, 16, 32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.zeros(5, 16, dtype=dtype)
        assert grouped_mm_supported(x, w.to(dtype)) and not grouped_mm_reads_offsets(x)
        assert grouped_mm_row_alignment(x) == 1
    assert not grouped_mm_supported(torch.zeros(5, 16, dtype=torch.float64), w.double())
    assert not grouped_mm_supported(torch.zeros(5, 6), torch.zeros(4, 6, 32))  # 24-byte rows


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
                    reason="needs a CUDA GPU of compute capability 9.x/10.x (the sync-free grouped GEMM)")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bf16_moe_is_sync_free_on_cuda(variant):
    """On a GPU the same forward + backward runs under torch.cuda's sync debug mode set to error, equals
    the CPU layer, and can be captured in a CUDA graph."""
    cfg = make_cfg(**VARIANTS[variant])
    cpu_layer = make_layer(cfg).to(torch.bfloat16)
    layer = make_layer(cfg).to("cuda", torch.bfloat16)
    x = torch.randn(2, 8, 16).to(torch.bfloat16)
    expected = cpu_layer(x).float()
    layer(x.cuda()).sum().backward()  # warm-up (lazy initialisation may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x.cuda())
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (y.float().cpu() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
    layer.eval()
    static = x.cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        layer(static)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = layer(static)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        torch.testing.assert_close(out, layer(static))


def test_host_sync_reasons_name_what_reads_the_device():
    """The predicate a CUDA-graph capture can ask: empty exactly where the counter above finds no read."""
    layer = make_layer(make_cfg())
    assert layer.host_sync_reasons(torch.float32, torch.device("cpu")) == []
    assert layer.host_sync_reasons(torch.bfloat16, torch.device("cpu")) == []
    assert "loop" in layer.host_sync_reasons(torch.float64, torch.device("cpu"))[0]
    layer.experts.grouped = False
    assert "loop" in layer.host_sync_reasons(torch.float32, torch.device("cpu"))[0]
    layer.experts.grouped = True

    class Custom:  # a dispatcher that does not say how often it reads
        def dispatch(self, tokens, probs, routing_map):
            raise NotImplementedError

    layer.dispatcher = Custom()
    assert layer.host_sync_reasons(torch.float32, torch.device("cpu")) == [
        "the token dispatcher (Custom) reads an unknown number of values per forward"]
