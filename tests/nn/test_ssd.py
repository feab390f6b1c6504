"""The SSD chunked scan against the plain token-by-token recurrence in fp64: outputs, final states and
gradients, for several chunk sizes (lengths not divisible by the chunk included), with an initial
state and with packed documents; and the one-token step."""

from __future__ import annotations

import pytest
import torch

from meshtron.nn.ssd import chunk_scan_torch, segment_sums, step

F64 = torch.float64


def recurrence(x, dt, A, B, C, initial=None, seq_ids=None):
    """S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t, one token at a time; a new document
    starts from zero."""
    batch, seq, heads, head_dim = x.shape
    per_group = heads // B.shape[2]
    S = torch.zeros(batch, heads, head_dim, B.shape[-1], dtype=F64) if initial is None else initial
    ys = []
    for t in range(seq):
        if seq_ids is not None and t > 0:
            S = S * (seq_ids[:, t] == seq_ids[:, t - 1]).to(F64)[:, None, None, None]
        Bt, Ct = B[:, t].repeat_interleave(per_group, 1), C[:, t].repeat_interleave(per_group, 1)
        S = torch.exp(dt[:, t] * A)[..., None, None] * S + (dt[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ct))
    return torch.stack(ys, 1), S


def inputs(seq=37, batch=2, heads=4, head_dim=3, groups=2, state=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads, head_dim, dtype=F64, generator=g)
    dt = torch.rand(batch, seq, heads, dtype=F64, generator=g) * 0.5
    A = -torch.rand(heads, dtype=F64, generator=g) * 3 - 0.1
    B = torch.randn(batch, seq, groups, state, dtype=F64, generator=g)
    C = torch.randn(batch, seq, groups, state, dtype=F64, generator=g)
    initial = torch.randn(batch, heads, head_dim, state, dtype=F64, generator=g)
    return x, dt, A, B, C, initial


DOCS = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [0] * 3 + [1] * 34])


def test_segment_sums_closed_form():
    a = torch.tensor([1.0, 2.0, 4.0], dtype=F64)  # cumulative sums 1, 3, 7
    inf = float("-inf")
    assert torch.equal(segment_sums(a.cumsum(0)), torch.tensor([[0, inf, inf], [2, 0, inf], [6, 4, 0]], dtype=F64))


@pytest.mark.parametrize("chunk", [1, 3, 8, 16, 64])
@pytest.mark.parametrize("case", ["zero_start", "initial_state", "documents"])
def test_chunk_scan_equals_recurrence(chunk, case):
    x, dt, A, B, C, initial = inputs()
    init = None if case == "zero_start" else initial
    ids = DOCS if case == "documents" else None
    y, final = chunk_scan_torch(x, dt, A, B, C, chunk, init, ids)
    y_ref, final_ref = recurrence(x, dt, A, B, C, init, ids)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(final, final_ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("chunk,ids", [(4, None), (8, DOCS), (64, None)])
def test_chunk_scan_gradients_equal_recurrence(chunk, ids):
    leaves = [t.requires_grad_() for t in inputs(seq=37)]
    g = torch.Generator().manual_seed(1)
    w_y = torch.randn(2, 37, 4, 3, dtype=F64, generator=g)
    w_s = torch.randn(2, 4, 3, 5, dtype=F64, generator=g)

    def grads(fn):
        x, dt, A, B, C, initial = leaves
        y, final = fn(x, dt, A, B, C, initial, ids)
        return torch.autograd.grad((y * w_y).sum() + (final * w_s).sum(), leaves)

    ours = grads(lambda x, dt, A, B, C, s, i: chunk_scan_torch(x, dt, A, B, C, chunk, s, i))
    ref = grads(recurrence)
    for name, a, b in zip(("x", "dt", "A", "B", "C", "initial"), ours, ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0, msg=name)


def test_padding_with_zero_dt_keeps_the_state():
    x, dt, A, B, C, initial = inputs(seq=20)
    _, final = chunk_scan_torch(x[:, :13], dt[:, :13], A, B[:, :13], C[:, :13], 8, initial)
    dt_padded = dt.clone()
    dt_padded[:, 13:] = 0
    _, final_padded = chunk_scan_torch(x, dt_padded, A, B, C, 8, initial)
    torch.testing.assert_close(final_padded, final, atol=1e-12, rtol=0)


def test_steps_equal_recurrence():
    x, dt, A, B, C, initial = inputs(seq=6)
    state, ys = initial, []
    for t in range(6):
        y, state = step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y)
    y_ref, final_ref = recurrence(x, dt, A, B, C, initial)
    torch.testing.assert_close(torch.stack(ys, 1), y_ref, atol=1e-13, rtol=0)
    torch.testing.assert_close(state, final_ref, atol=1e-13, rtol=0)


def test_fp32_inputs_keep_their_dtype_and_stay_close():
    x, dt, A, B, C, initial = inputs()
    y, final = chunk_scan_torch(*(t.float() for t in (x, dt, A, B, C)), 16, initial.float())
    y_ref, final_ref = recurrence(x, dt, A, B, C, initial)
    assert y.dtype == torch.float32 and final.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(final.double(), final_ref, atol=2e-5, rtol=0)
