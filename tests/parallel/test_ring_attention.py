"""Ring attention over 2 and 4 gloo ranks equals full single-process attention (attention_core.attend):
outputs and q/k/v (and sink) gradients, fp32, for causal, zig-zag vs contiguous sharding, sliding
windows, packed documents, sinks, grouped-query heads and a value width unlike the key width."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# imported here, not in the rank functions: the launcher imports this module once before forking
from meshtron.nn.attention_core import attend
from meshtron.nn.context import PackedContext
from meshtron.parallel.context_parallel import ContextParallel, cp_segments, global_indices
from meshtron.parallel.dims import backend_options
from meshtron.testing.multiprocess import run_ranks

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


def document_ids(seed: int) -> torch.Tensor:
    """(batch, seq): a few documents of random lengths per row, different in each row."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(BATCH):
        cuts = torch.randperm(SEQ - 1, generator=gen)[:4] + 1
        starts = torch.zeros(SEQ, dtype=torch.long)
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def reference(case, seed: int, dtype=torch.float32):
    """Full tensors, the single-process output and gradients."""
    _, heads, kv_heads, window, docs, sinks, dv = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, SEQ, 8, generator=gen)
    k = torch.randn(BATCH, kv_heads, SEQ, 8, generator=gen)
    v = torch.randn(BATCH, kv_heads, SEQ, dv, generator=gen)
    d_out = torch.randn(BATCH, heads, SEQ, dv, generator=gen)
    sink = torch.randn(heads, generator=gen) if sinks else None
    doc_ids = document_ids(seed) if docs else None
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    sink_in = sink.clone().requires_grad_() if sink is not None else None
    ctx = PackedContext.for_tokens(torch.zeros(BATCH, SEQ, dtype=torch.long), doc_ids)
    # the reference always computes in fp32 (from the same, possibly bf16-rounded, inputs)
    out = attend(*(t.float() for t in inputs), ctx, scale=0.3, window_size=window, sink_logits=sink_in)
    out.backward(d_out)
    grads = [t.grad for t in inputs] + [sink_in.grad if sink is not None else None]
    return inputs, sink, doc_ids, d_out, out.detach(), grads, ctx


def max_error(value: torch.Tensor, ref: torch.Tensor, relative: bool) -> float:
    """Max abs difference, relative to the reference's largest magnitude when `relative`."""
    err = (value.float() - ref.float()).abs().max().item()
    return err / ref.float().abs().max().item() if relative else err


def run_case(cp, case, seed: int, dtype=torch.float32) -> dict[str, float]:
    """Max abs errors of this rank's shard against the reference."""
    inputs, sink, doc_ids, d_out, ref_out, ref_grads, ref_ctx = reference(case, seed, dtype)
    cp.load_balance = case[0]
    idx = global_indices(cp.segments(SEQ)[cp.rank], torch.device("cpu"))
    mb = {"input_ids": torch.zeros(BATCH, SEQ, dtype=torch.long)}
    if doc_ids is not None:
        mb["document_ids"] = doc_ids
    ctx = cp.context(cp.shard_batch(mb))
    local = [t.detach()[:, :, idx].clone().requires_grad_() for t in inputs]
    local_sink = sink.clone().requires_grad_() if sink is not None else None
    out = ctx.attend(*local, scale=0.3, window_size=case[3], sink_logits=local_sink)
    out.float().backward(d_out[:, :, idx].to(out.dtype))
    errors = {"out": max_error(out, ref_out[:, :, idx], relative=dtype != torch.float32)}
    for name, t, ref in zip(("dq", "dk", "dv"), local, ref_grads):
        errors[name] = max_error(t.grad, ref[:, :, idx], relative=dtype != torch.float32)
    if local_sink is not None:  # each rank holds the sink gradient of its own query rows: sum over cp
        total = local_sink.grad.clone()
        dist.all_reduce(total, group=cp.group)
        errors["dsink"] = (total - ref_grads[3]).abs().max().item()
    mask = ctx.attention_mask(case[3])  # the global-key mask of these queries, for non-ring callers
    errors["mask"] = float((mask != ref_ctx.attention_mask(case[3])[:, :, idx]).sum())
    errors["positions"] = float((ctx.positions != idx).sum())
    return errors


def ring_cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",),
                            backend_override={"cp": backend_options("cpu", 60)})
    cp = ContextParallel(mesh["cp"])
    results = {name: run_case(cp, case, seed=i) for i, (name, case) in enumerate(CASES.items())}
    results["bf16"] = run_case(cp, CASES["everything"], seed=99, dtype=torch.bfloat16)
    try:
        cp.context({"input_ids": torch.zeros(1, 8, dtype=torch.long)}).attend(
            *(torch.zeros(1, 2, 8, 4) for _ in range(3)), scale=1.0, dropout=0.1)
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
