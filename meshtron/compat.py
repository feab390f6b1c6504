"""Private PyTorch APIs behind one module: each is used only through a function here that says when it
applies, so a PyTorch upgrade that moves or changes one is fixed in one place.

`PipelineStage._forward_metadata_inference`: before its first step a pipeline stage runs its module once
on placeholder tensors (uninitialised values) to learn output shapes; `during_pipeline_shape_inference`
lets a caller wrap that run (MoE layers must not count or record it).

`is_fake`: whether a tensor is a FakeTensor (shapes without data, e.g. `meshtron plan`'s trace); code
whose shapes depend on data (MoE routing) takes a static-shaped path then.

`torch._grouped_mm(x, w, offs)` multiplies consecutive row blocks of x (2-D) by the matrices of w (3-D):
rows offs[g-1]:offs[g] by w[g]. Measured on torch 2.13 (CPU): fp32/bf16/fp16 work forward and backward,
fp64 is refused, every row stride must be a multiple of 16 bytes, and backward fails on an expanded
(stride 0) output gradient, so the output passes through `_contiguous_grad`. On CUDA (read from ATen's
GroupedBlas.cpp / GroupMMCommon.cuh, not run here): bf16 on compute capability 9.x/10.x runs a CUTLASS
kernel that reads the offsets on the device; every other case ATen's fallback, which copies them to the host.

`sdpa_block_forward` / `sdpa_block_backward`: one attention block and its log-sum-exp through the fused
SDPA kernels' private ops (`aten._scaled_dot_product_flash_attention_for_cpu[_backward]`, on CUDA
`aten._scaled_dot_product_{flash,efficient}_attention[_backward]`), for ring attention.

Smaller ones, each a single attribute: `flatten_mesh` (`DeviceMesh._flatten`: one axis over several,
e.g. dp over dp_replicate x dp_shard), `nccl_options` (`ProcessGroupNCCL.Options._timeout`, the only way
to give a sub-group's NCCL communicator its own timeout), `default_store` (the TCPStore of the default
group, for heartbeats), `storage_key` (`UntypedStorage._cdata`, the storage's identity even for fake or
meta tensors), `tensor_version` (`Tensor._version`, bumped by every in-place write), `in_autograd_backward`
(`torch._C._current_graph_task_id`), `is_view` (`Tensor._base`), `recompile_limit` (dynamo's per-function
limit of compiled variants), `fake_tensor_mode`, `tree_map` and `TorchDispatchMode` (private
modules of torch that have no public home yet). `tests/test_private_torch.py` fails when a private
PyTorch name is used anywhere else in meshtron.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `grouped_mm(x, w, offs)` runs for these operands: x (rows, k), w (groups, k, n). Both CPU
    and CUDA take fp32/bf16/fp16 (CUDA: a CUTLASS kernel for bf16 on compute capability 9.x/10.x, else
    ATen's fallback, see grouped_mm_reads_offsets); every row stride must be a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype or x.device.type not in ("cpu", "cuda"):
        return False
    size = x.element_size()
    return x.dtype in _GROUPED_DTYPES and (w.shape[-2] * size) % 16 == 0 and (w.shape[-1] * size) % 16 == 0


def grouped_mm_reads_offsets(x: torch.Tensor) -> bool:
    """Whether `grouped_mm` copies its offsets to the host (a device sync, and no CUDA-graph capture):
    ATen's CUDA fallback (any dtype but bf16, or a GPU other than compute capability 9.x/10.x) loops
    over the groups on the host; the CUTLASS kernel and the CPU kernel read them where they are."""
    if x.device.type != "cuda":
        return False
    return x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] not in (9, 10)


def grouped_mm_row_alignment(x: torch.Tensor) -> int:
    """Rows each group of `grouped_mm` should start at a multiple of: on CUDA 16 bytes of a row element
    (8 for bf16), so that every group's first row is 16-byte aligned for TMA loads whatever the operand
    layout (ATen's kernel checks this only for some layouts; inductor's grouped-GEMM template is tuned
    for aligned offsets); 1 on CPU."""
    return 16 // x.element_size() if x.device.type == "cuda" else 1


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (rows, k) @ w[g] (k, n) for each row block g ending at offs[g] (int32, cumulative) -> (rows, n)."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))


def during_pipeline_shape_inference(stage, context: Callable[[], AbstractContextManager]) -> None:
    """Run `stage`'s placeholder forward (shape inference) inside `context()`; a no-op on PyTorch
    builds whose stages infer shapes another way."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return

    def wrapped(*args, **kwargs):
        with context():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = wrapped


def is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor, or a meta tensor: shapes only, no values to route by."""
    if t.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return bool(_is_fake(t))


# ---- attention blocks with their log-sum-exp (ring attention) ---------------------------------------
# The fused SDPA kernels that also return the per-row log-sum-exp, and their backward ops: the CPU flash
# kernel (`_scaled_dot_product_flash_attention_for_cpu`: fp32/fp64/bf16/fp16, grouped-query heads, an additive
# mask of q's dtype; a fully masked row comes back as out 0, lse 0; a zero-length block crashes the process),
# and on CUDA flash attention (bf16/fp16, no mask) or memory-efficient attention (fp32 too, an additive bias
# whose rows are padded to 16 elements; its lse has its rows padded to a multiple of 32). Both CUDA kernels get
# equal head counts (k/v repeated) and equal q/k/v head widths, padded with zeros to a multiple of 8.

_SDPA_LSE_DTYPES = {"cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
                    "cuda": (torch.float32, torch.bfloat16, torch.float16)}


def sdpa_lse_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `sdpa_block_forward`/`sdpa_block_backward` run for these operands."""
    ok = q.dtype in _SDPA_LSE_DTYPES.get(q.device.type, ()) and q.dtype == k.dtype == v.dtype
    return ok and q.shape[1] % k.shape[1] == 0 and min(q.shape[2], k.shape[2]) > 0


def sdpa_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, is_causal: bool = False,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale q k^T [+ mask]) v and its log-sum-exp for one block, through a fused kernel.

    q (b, h, n, d), k (b, kvh, m, d), v (b, kvh, m, dv) of one dtype; mask: None or bool broadcastable to
    (b, 1, n, m), True where the query may see the key; is_causal: the causal mask of a square block (no
    tensor). -> out (b, h, n, dv) in q's dtype, lse (b, h, n) in fp32 (fp64 for fp64 inputs); a row that
    sees no key gets out 0 and lse -inf. Memory: the kernel's tiles, plus the additive mask when given."""
    n, width = q.shape[2], v.shape[-1]
    q, k, v = _equal_head_widths(q, k, v)
    bias = None if mask is None else _additive_mask(mask, q.dtype)
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=bias,
                                                                    scale=scale)
    else:
        k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
        if _cuda_flash(q, bias):
            out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
        else:
            out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, _cuda_bias(bias, q), True, 0.0,
                                                                    is_causal, scale=scale)[:2]
            lse = lse[..., :n]
    out, lse = out[..., :width], lse.to(torch.promote_types(q.dtype, torch.float32))
    if mask is not None:  # the kernels disagree about rows that see nothing (CPU: lse 0): make them (0, -inf)
        seen = mask.any(-1)  # (b or 1, 1, n)
        lse = lse.masked_fill(~seen, float("-inf"))
        out = out.masked_fill(~seen[..., None], 0.0)
    return out, lse


def sdpa_block_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, *, scale: float, is_causal: bool = False,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block in q's dtype, given the FINAL statistics of its query rows: out (b, h, n, dv)
    the whole attention output (q's dtype) and lse (b, h, n) its log-sum-exp over all keys (+inf for a row
    that sees no key). The kernels form p = exp(scale q k^T - lse), this block's share of the final
    probabilities, and delta = rowsum(grad_out * out), so the blocks' gradients sum to the exact ones."""
    d, width, kv_heads, n, m = q.shape[-1], v.shape[-1], k.shape[1], q.shape[2], k.shape[2]
    q, k, v = _equal_head_widths(q, k, v)
    grad_out, out = _pad_last(grad_out, q.shape[-1]), _pad_last(out, q.shape[-1])
    lse = lse.to(torch.promote_types(q.dtype, torch.float32)).contiguous()  # the kernels index it as (b, h, n)
    bias = None if mask is None else _additive_mask(mask, q.dtype)
    aten = torch.ops.aten
    if q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale)
    else:
        k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
        seed, offset = _rng_placeholders(_cuda_flash(q, bias), q.device)
        if _cuda_flash(q, bias):
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, lse, None, None, n, m, 0.0, is_causal, seed, offset, scale=scale)
        else:
            rows = -(-n // 32) * 32
            lse = torch.nn.functional.pad(lse, (0, rows - n), value=float("inf")) if rows > n else lse
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                grad_out, q, k, v, _cuda_bias(bias, q), out, lse, seed, offset, 0.0,
                [True, True, True, False], is_causal, scale=scale)
        dk, dv = _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)
    return dq[..., :d], dk[..., :d], dv[..., :width]


def _equal_head_widths(q, k, v):
    """Pad q, k and v with zero columns to one head width (a multiple of 8 on CUDA): q.k and p v unchanged."""
    width = max(q.shape[-1], v.shape[-1])
    if q.device.type != "cpu":
        width = -(-width // 8) * 8
    return _pad_last(q, width), _pad_last(k, width), _pad_last(v, width)


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _cuda_flash(q: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (bias is None and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256
            and torch.cuda.get_device_capability(q.device)[0] >= 8)


def _cuda_bias(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The additive mask as memory-efficient attention reads it: rows padded to 16 elements, (b, h, n, m)."""
    if bias is None:
        return None
    _, _, n, m = bias.shape
    padded = bias.new_zeros(bias.shape[0], 1, n, -(-m // 16) * 16)
    padded[..., :m] = bias
    return padded[..., :m].expand(q.shape[0], q.shape[1], n, m)


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, kvh, m, d) -> (b, heads, m, d): query head i uses kv head i // (heads // kvh)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, heads, m, d = t.shape
    return t if heads == kv_heads else t.view(b, kv_heads, heads // kv_heads, m, d).sum(2)


_RNG_PLACEHOLDERS: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _rng_placeholders(flash: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (philox seed, philox offset) the CUDA backward ops take: unused without dropout, but of the kind
    their forward returns, so they are taken from one tiny forward per kernel and device."""
    key = (flash, device)
    if key not in _RNG_PLACEHOLDERS:
        aten = torch.ops.aten
        x = torch.zeros(1, 1, 8, 8, device=device, dtype=torch.bfloat16 if flash else torch.float32)
        if flash:
            _RNG_PLACEHOLDERS[key] = tuple(aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)[6:8])
        else:
            _RNG_PLACEHOLDERS[key] = tuple(aten._scaled_dot_product_efficient_attention(x, x, x, None, True)[2:4])
    return _RNG_PLACEHOLDERS[key]


def flatten_mesh(mesh, name: str, backend_override=None):
    """The 1-D mesh over all axes of `mesh` (a slice of the root mesh), registered under `name`."""
    return mesh._flatten(name, backend_override=backend_override)


def nccl_options(timeout):
    """NCCL process-group options carrying `timeout` (a timedelta)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def default_store():
    """The key-value store of the default process group (the TCPStore torchrun or init_process_group made)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def storage_key(t: torch.Tensor) -> int:
    """An id of the StorageImpl behind `t` (equal for views of one allocation; defined for fake/meta tensors)."""
    return t.untyped_storage()._cdata


def tensor_version(t: torch.Tensor) -> int:
    """The counter every in-place write to `t`'s storage bumps (how autograd detects a changed saved tensor)."""
    return t._version


def in_autograd_backward() -> bool:
    """True while the autograd engine runs a backward (including recomputation inside it)."""
    return torch._C._current_graph_task_id() != -1


def fake_tensor_mode():
    """A FakeTensorMode: tensors with shapes, dtypes and devices but no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def tree_map(fn: Callable, tree):
    """`fn` applied to every leaf of nested lists/tuples/dicts, the structure kept."""
    from torch.utils._pytree import tree_map as _tree_map

    return _tree_map(fn, tree)


def dispatch_mode_base() -> type:
    """The TorchDispatchMode base class: a subclass sees every aten operator call while active."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def is_view(t: torch.Tensor) -> bool:
    """Whether `t` is a view of another tensor's storage (autograd tracks it through its base)."""
    return t._base is not None


def recompile_limit(limit: int):
    """A context in which torch.compile keeps up to `limit` compiled variants of a function (default 8)."""
    return torch._dynamo.config.patch(recompile_limit=limit)
