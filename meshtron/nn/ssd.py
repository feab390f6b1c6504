"""The SSD (state-space duality) scan of Mamba-2, in plain PyTorch.

Per head h the selective state space model is the recurrence (state S_t: head_dim x state_dim)
    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,        y_t = S_t C_t
with a scalar decay per head and step, B and C shared by the heads of a group. Unrolled, it is a
masked "attention" y_i = sum_{j<=i} exp(a_{j+1} + ... + a_i) (C_i . B_j) dt_j x_j with a_t = dt_t A_h.
`chunk_scan` splits the sequence into chunks of L tokens and computes
  1. inside each chunk, that quadratic form (matmuls, parallel over chunks);
  2. each chunk's contribution to the state at its end;
  3. across chunks, the recurrence on those states (a loop over chunks: elementwise work only);
  4. each token's read-out of the state its chunk started from.
Decays are differences of the within-chunk cumulative sums c_i = a_1 + ... + a_i, masked to j <= i
before exp (so exp never sees a positive argument), as the fused kernels compute them; c restarts
at every chunk, so its magnitude (and the rounding of the differences) stays bounded by one chunk.

Documents: with `seq_ids` (batch, seq) — contiguous runs of equal ids, e.g. packed documents —
the state never crosses from one run to the next, exactly as if each ran alone from a zero state.
The initial state belongs to the run of the first token. Padding a sequence with dt = 0 leaves
the state unchanged (decay exp(0) = 1, no input), which is how callers pad.

`step` is the recurrence for one token (decoding). If the `mamba_ssm` package is installed and
the tensors are on a GPU, `chunk_scan` uses its fused Triton kernel for the same math.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import torch


def segment_sums(cum: torch.Tensor) -> torch.Tensor:
    """cum (..., L) cumulative sums c_i -> (..., L, L) with out[..., i, j] = c_i - c_j for j <= i, -inf above."""
    length = cum.shape[-1]
    idx = torch.arange(length, device=cum.device)
    return (cum[..., :, None] - cum[..., None, :]).masked_fill(idx[:, None] < idx[None, :], float("-inf"))


@functools.lru_cache(maxsize=1)
def _fused_kernel() -> Optional[Callable]:
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        return None
    return mamba_chunk_scan_combined


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               chunk_size: int, initial_state: Optional[torch.Tensor] = None,
               seq_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (batch, seq, heads, head_dim), dt (batch, seq, heads) >= 0, A (heads,) < 0,
    B, C (batch, seq, groups, state_dim), initial_state (batch, heads, head_dim, state_dim) or None
    -> y (batch, seq, heads, head_dim) in x's dtype, final state (batch, heads, head_dim, state_dim) fp32+."""
    kernel = _fused_kernel() if x.is_cuda and seq_ids is None else None
    if kernel is not None:
        y, final = kernel(x, dt, A, B, C, chunk_size, initial_states=initial_state, return_final_states=True)
        return y, final
    return chunk_scan_torch(x, dt, A, B, C, chunk_size, initial_state, seq_ids)


def chunk_scan_torch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     chunk_size: int, initial_state: Optional[torch.Tensor] = None,
                     seq_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_scan` in plain PyTorch (any device, any float dtype; computes in at least fp32)."""
    batch, seq, heads, head_dim = x.shape
    groups, state_dim = B.shape[2:]
    r = heads // groups  # heads per group
    L = max(1, min(chunk_size, seq))  # a shorter sequence is one chunk of its own length (same result, no padding)
    compute = torch.promote_types(x.dtype, torch.float32)
    pad = (-seq) % L
    n = (seq + pad) // L  # chunks

    def chunked(t: torch.Tensor) -> torch.Tensor:  # (batch, seq, ...) -> (batch, chunks, L, ...), zero-padded
        t = t.to(compute)
        if pad:
            t = torch.cat([t, t.new_zeros(batch, pad, *t.shape[2:])], dim=1)
        return t.view(batch, n, L, *t.shape[2:])

    xs = chunked(x).view(batch, n, L, groups, r, head_dim)
    dts = chunked(dt).view(batch, n, L, groups, r)
    Bs, Cs = chunked(B), chunked(C)  # (batch, chunks, L, groups, state_dim)
    xdt = xs * dts[..., None]  # dt_j x_j
    a = (dts * A.to(compute).view(groups, r)).permute(0, 1, 3, 4, 2)  # (batch, chunks, groups, r, L), <= 0
    from_start = a.cumsum(-1)  # log-decay from the chunk's start state to token i
    seg = segment_sums(from_start)  # (batch, chunks, groups, r, L, L): log-decay from token j to token i
    whole = from_start[..., -1]  # (batch, chunks, groups, r): log-decay across the chunk
    to_end = whole[..., None] - from_start  # log-decay from token j to the chunk's last token

    same_doc = same_to_end = from_prev = carry = None
    if seq_ids is not None:
        ids = seq_ids if not pad else torch.cat([seq_ids, seq_ids[:, -1:].expand(batch, pad)], dim=1)
        ids = ids.view(batch, n, L)
        prev = torch.cat([ids[:, :1, 0], ids[:, :-1, -1]], dim=1)  # (batch, chunks): id of the token before each chunk
        same_doc = (ids[:, :, :, None] == ids[:, :, None, :])[:, :, None, None]  # (batch, chunks, 1, 1, L, L)
        same_to_end = (ids == ids[:, :, -1:])[:, :, None, None]  # (batch, chunks, 1, 1, L)
        from_prev = (ids == prev[:, :, None])[:, :, None, None]
        carry = (ids[:, :, -1] == prev)[:, :, None, None]  # (batch, chunks, 1, 1)

    # 1. inside each chunk: y_i = sum_{j <= i} exp(seg_ij) (C_i . B_j) dt_j x_j
    scores = torch.einsum("bclgn,bcsgn->bcgls", Cs, Bs)  # (batch, chunks, groups, L, L)
    decay = torch.exp(seg)
    if same_doc is not None:
        decay = decay * same_doc
    y = torch.einsum("bcgrls,bcsgrp->bclgrp", scores[:, :, :, None] * decay, xdt)

    # 2. each chunk's own contribution to the state at its end
    w_end = torch.exp(to_end)
    if same_to_end is not None:
        w_end = w_end * same_to_end
    chunk_states = torch.einsum("bclgn,bcgrl,bclgrp->bcgrpn", Bs, w_end, xdt)

    # 3. across chunks: S_c = exp(whole_c) S_{c-1} + chunk_states_c; keep each chunk's start state
    state = (x.new_zeros(batch, heads, head_dim, state_dim, dtype=compute) if initial_state is None
             else initial_state.to(compute)).view(batch, groups, r, head_dim, state_dim)
    w_whole = torch.exp(whole)
    if carry is not None:
        w_whole = w_whole * carry
    starts = []
    for c in range(n):
        starts.append(state)
        state = w_whole[:, c, :, :, None, None] * state + chunk_states[:, c]
    start_states = torch.stack(starts, dim=1)  # (batch, chunks, groups, r, head_dim, state_dim)

    # 4. read-out of the start state: y_i += exp(from_start_i) C_i . S_{c-1}
    w_start = torch.exp(from_start)
    if from_prev is not None:
        w_start = w_start * from_prev
    y = y + torch.einsum("bclgn,bcgrpn,bcgrl->bclgrp", Cs, start_states, w_start)
    y = y.reshape(batch, n * L, heads, head_dim)[:, :seq]
    return y.to(x.dtype), state.reshape(batch, heads, head_dim, state_dim)


def step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
         C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: state (batch, heads, head_dim, state_dim), x (batch, heads, head_dim), dt (batch, heads),
    B, C (batch, groups, state_dim) -> y (batch, heads, head_dim) in x's dtype, the new state."""
    batch, heads, head_dim = x.shape
    groups = B.shape[1]
    compute = torch.promote_types(x.dtype, torch.float32)
    dt = dt.to(compute)
    decay = torch.exp(dt * A.to(compute)).view(batch, groups, -1, 1, 1)
    xdt = (x.to(compute) * dt[..., None]).view(batch, groups, -1, head_dim)
    s = state.to(compute).view(batch, groups, -1, head_dim, state.shape[-1])
    s = decay * s + xdt[..., None] * B.to(compute)[:, :, None, None, :]
    y = torch.einsum("bgrpn,bgn->bgrp", s, C.to(compute))
    return y.reshape(batch, heads, head_dim).to(x.dtype), s.reshape(state.shape)
