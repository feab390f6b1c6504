"""Ring attention over 2 and 4 ranks (gloo, or NCCL under MESHTRON_TEST_BACKEND=nccl) equals full single-process attention (attention_core.attend):
outputs and q/k/v (and sink) gradients, fp32, for causal, zig-zag vs contiguous sharding, sliding
windows, packed documents, sinks, grouped-query heads and a value width unlike the key width, through
the fused kernels (also with masks cut into tiles) and through the plain fp32 math. Memory: no tensor
of a (query block x key block) size is made by the kernels' path (it is by the math path), counted
with a dispatch mode; on CUDA (skipped here) the same parity and the peak allocation."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# imported here, not in the rank functions: the launcher imports this module once before forking
from meshtron.nn.attention_core import attend
from meshtron.nn.context import PackedContext
from meshtron.parallel.context_parallel import ContextParallel, cp_segments, global_indices
from meshtron.parallel.dims import backend_options
from meshtron.parallel.ring_attention import RingLayout, ring_attention
from meshtron.testing.multiprocess import rank_backend, rank_device, rank_device_type, run_ranks

SEQ, BATCH = 32, 2

# name -> (load_balance, heads, kv_heads, window_size, documents, sinks, value_dim)
CASES = {
    "causal_zigzag": (True, 4, 4, None, False, False, 8),
    "causal_contiguous": (False, 4, 4, None, False, False, 8),
    "gqa_zigzag": (True, 4, 2, None, False, False, 8),
    "mqa_value_dim": (True, 4, 1, None, False, False, 6),
    "window_zigzag": (True, 4, 2, 5, False, False, 8),
    "window_contiguous": (False, 4, 2, 11, False, False, 8),
    "documents_zigzag": (True, 4, 2, None, True, False, 8),
    "documents_window_contiguous": (False, 4, 4, 6, True, False, 8),
    "sinks_gqa": (True, 4, 2, None, False, True, 8),
    "everything": (True, 6, 2, 7, True, True, 8),
}


def document_ids(seed: int, seq: int = SEQ) -> torch.Tensor:
    """(batch, seq): a few documents of random lengths per row, different in each row."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(BATCH):
        cuts = torch.randperm(seq - 1, generator=gen)[:4] + 1
        starts = torch.zeros(seq, dtype=torch.long)
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def reference(case, seed: int, dtype=torch.float32, seq: int = SEQ):
    """Full tensors, the single-process output and gradients."""
    _, heads, kv_heads, window, docs, sinks, dv = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, seq, 8, generator=gen)
    k = torch.randn(BATCH, kv_heads, seq, 8, generator=gen)
    v = torch.randn(BATCH, kv_heads, seq, dv, generator=gen)
    d_out = torch.randn(BATCH, heads, seq, dv, generator=gen)
    sink = torch.randn(heads, generator=gen) if sinks else None
    doc_ids = document_ids(seed, seq) if docs else None
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    sink_in = sink.clone().requires_grad_() if sink is not None else None
    ctx = PackedContext.for_tokens(torch.zeros(BATCH, seq, dtype=torch.long), doc_ids)
    # the reference always computes in fp32 (from the same, possibly bf16-rounded, inputs)
    out = attend(*(t.float() for t in inputs), ctx, scale=0.3, window_size=window, sink_logits=sink_in)
    out.backward(d_out)
    grads = [t.grad for t in inputs] + [sink_in.grad if sink is not None else None]
    return inputs, sink, doc_ids, d_out, out.detach(), grads, ctx


def max_error(value: torch.Tensor, ref: torch.Tensor, relative: bool) -> float:
    """Max abs difference, relative to the reference's largest magnitude when `relative`."""
    value, ref = value.float().cpu(), ref.float().cpu()
    err = (value - ref).abs().max().item()
    return err / ref.abs().max().item() if relative else err


def run_case(cp, case, seed: int, dtype=torch.float32, **layout) -> dict[str, float]:
    """Max abs errors of this rank's shard against the reference; `layout`: RingLayout fields to set
    (kernels, mask_tile)."""
    inputs, sink, doc_ids, d_out, ref_out, ref_grads, ref_ctx = reference(case, seed, dtype)
    device = rank_device()
    cp.load_balance = case[0]
    idx = global_indices(cp.segments(SEQ)[cp.rank], torch.device("cpu"))
    mb = {"input_ids": torch.zeros(BATCH, SEQ, dtype=torch.long, device=device)}
    if doc_ids is not None:
        mb["document_ids"] = doc_ids.to(device)
    ctx = cp.context(cp.shard_batch(mb))
    for name, value in layout.items():
        setattr(ctx.layout, name, value)
    local = [t.detach()[:, :, idx].to(device).requires_grad_() for t in inputs]
    local_sink = sink.to(device).requires_grad_() if sink is not None else None
    out = ctx.attend(*local, scale=0.3, window_size=case[3], sink_logits=local_sink)
    out.float().backward(d_out[:, :, idx].to(device, out.dtype))
    errors = {"out": max_error(out, ref_out[:, :, idx], relative=dtype != torch.float32)}
    for name, t, ref in zip(("dq", "dk", "dv"), local, ref_grads):
        errors[name] = max_error(t.grad, ref[:, :, idx], relative=dtype != torch.float32)
    if local_sink is not None:  # each rank holds the sink gradient of its own query rows: sum over cp
        total = local_sink.grad.clone()
        dist.all_reduce(total, group=cp.group)
        errors["dsink"] = (total.cpu() - ref_grads[3]).abs().max().item()
    mask = ctx.attention_mask(case[3]).cpu()  # the global-key mask of these queries, for non-ring callers
    errors["mask"] = float((mask != ref_ctx.attention_mask(case[3])[:, :, idx]).sum())
    errors["positions"] = float((ctx.positions.cpu() != idx).sum())
    return errors


def ring_cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=60))
    mesh = init_device_mesh(rank_device_type(), (world_size,), mesh_dim_names=("cp",),
                            backend_override={"cp": backend_options(rank_device_type(), 60)})
    cp = ContextParallel(mesh["cp"])
    results = {name: run_case(cp, case, seed=i) for i, (name, case) in enumerate(CASES.items())}
    results["bf16"] = run_case(cp, CASES["everything"], seed=99, dtype=torch.bfloat16)
    # masks cut into 3-token tiles (tiles straddle the segments' ends), and the plain fp32 math per block
    results["tiles_everything"] = run_case(cp, CASES["everything"], seed=7, mask_tile=3)
    results["tiles_documents"] = run_case(cp, CASES["documents_window_contiguous"], seed=8, mask_tile=5)
    results["math_everything"] = run_case(cp, CASES["everything"], seed=9, kernels=False)
    try:
        cp.context({"input_ids": torch.zeros(1, 8, dtype=torch.long, device=rank_device())}).attend(
            *(torch.zeros(1, 2, 8, 4, device=rank_device()) for _ in range(3)), scale=1.0, dropout=0.1)
        results["dropout_error"] = "no error"
    except ValueError as e:
        results["dropout_error"] = str(e)
    return results


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_attention_matches_full_attention(world_size):
    results = run_ranks("tests.parallel.test_ring_attention:ring_cases", world_size, timeout_s=120)
    for rank, errors_by_case in enumerate(results):
        assert "model.attention_dropout" in errors_by_case.pop("dropout_error")
        bf16 = errors_by_case.pop("bf16")
        for case, errors in errors_by_case.items():
            for name, err in errors.items():
                assert err <= 1e-5, f"rank {rank} case {case}: {name} differs by {err}"
        # bf16 in, fp32 math inside: only the rounding of outputs and gradients to bf16 remains
        # (relative errors; a bf16 ulp is 2^-8 = 3.9e-3 relative)
        assert max(bf16["out"], bf16["dq"], bf16["dk"], bf16["dv"]) <= 1e-2 and bf16["mask"] == 0, bf16


def test_zigzag_segments():
    assert [cp_segments(r, 2, 8, True) for r in range(2)] == [[(0, 2), (6, 2)], [(2, 2), (4, 2)]]
    assert [cp_segments(r, 2, 8, False) for r in range(2)] == [[(0, 4)], [(4, 4)]]
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 4"):
        cp_segments(0, 2, 6, True)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (bytes) any aten op returns, and the names of the ops that ran."""

    def __init__(self):
        super().__init__()
        self.largest, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def one_rank_ring(case, seq: int, device="cpu", dtype=torch.float32, **layout):
    """Ring attention on one rank holding the two zig-zag segments of `seq` tokens (blocks of seq/2 x seq/2):
    (output, q/k/v/sink gradients, the LargestTensor record, the reference's output and gradients)."""
    inputs, sink, doc_ids, d_out, ref_out, ref_grads, _ = reference(case, seed=3, seq=seq)
    ring_layout = RingLayout(None, 0, 1, [cp_segments(0, 1, seq, True)],
                             None if doc_ids is None else [doc_ids.to(device)], **layout)
    local = [t.detach().to(device, dtype).requires_grad_() for t in inputs]
    local_sink = sink.to(device).requires_grad_() if sink is not None else None
    with LargestTensor() as record:
        out = ring_attention(*local, ring_layout, scale=0.3, window_size=case[3], sink_logits=local_sink)
        out.backward(d_out.to(device, dtype))
    grads = [t.grad for t in local] + [local_sink.grad if sink is not None else None]
    return out.detach(), grads, record, ref_out, ref_grads


@pytest.mark.parametrize("name", ["causal_zigzag", "mqa_value_dim", "window_zigzag", "documents_zigzag", "everything"])
def test_ring_blocks_hold_no_score_block(name):
    """The largest intermediate of a ring forward + backward: O(tokens x head_dim) through the kernels (masks
    in 64-token tiles), O(batch x heads x block_q x block_k) fp32 through the plain math (the old path)."""
    case, seq = CASES[name], 512
    _, heads, _, _, _, _, dv = case
    block = BATCH * heads * (seq // 2) ** 2 * 4                 # one fp32 score block: 2 MiB for 4 heads
    activations = BATCH * heads * seq * max(8, dv) * 4         # the fp32 dq accumulator: 128 KiB
    out, grads, record, ref_out, ref_grads = one_rank_ring(case, seq, mask_tile=64)
    assert "_scaled_dot_product_flash_attention_for_cpu" in record.ops, record.ops
    assert record.largest <= activations < block / 8, (record.largest, activations, block)
    for value, ref in zip([out, *grads], [ref_out, *ref_grads]):
        if ref is not None:
            assert (value - ref).abs().max().item() <= 1e-5
    _, _, old, _, _ = one_rank_ring(case, seq, kernels=False)  # the plain math with untiled masks
    assert "_scaled_dot_product_flash_attention_for_cpu" not in old.ops
    assert old.largest >= block, (old.largest, block)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_attention_kernels_on_cuda(dtype):
    """Every case through the CUDA kernels (flash for unmasked bf16 blocks, memory-efficient otherwise)
    equals the fp32 single-process reference, and the peak allocation stays far below one score block."""
    for name, case in CASES.items():
        out, grads, _, ref_out, ref_grads = one_rank_ring(case, 256, device="cuda", dtype=dtype, mask_tile=64)
        for value, ref in zip([out, *grads], [ref_out, *ref_grads]):
            if ref is not None:
                err = max_error(value.cpu(), ref, relative=dtype != torch.float32)
                assert err <= (2e-2 if dtype == torch.bfloat16 else 1e-4), (name, err)
    seq, heads = 16384, 8
    q = torch.randn(1, heads, seq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = [torch.randn(1, 2, seq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    layout = RingLayout(None, 0, 1, [cp_segments(0, 1, seq, True)])
    ring_attention(q, *kv, layout, scale=0.125).sum().backward()
    torch.cuda.synchronize()
    block = heads * (seq // 2) ** 2 * 4  # 2 GiB of fp32 scores per block
    assert torch.cuda.max_memory_allocated() - base < block / 16
