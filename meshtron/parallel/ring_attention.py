"""Ring attention: softmax(scale q k^T + mask [+ sink]) v over a sequence split across the `cp` ranks.

Each of the P ranks holds the queries, keys and values of its own tokens (a few contiguous segments
of the global sequence, see context_parallel.py). Key/value blocks travel around the ring so that
every rank meets every block; the rank merges the blockwise results with log-sum-exp:
    o_b = softmax(a_b) v_b,   lse_b = log sum_j exp(a_bj)            (a = scale q k^T, masked = -inf)
    lse = log(exp(lse_1) + exp(lse_2)),   o = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2
A sink logit s_h is one more block with zero value: lse_total = log(exp(lse) + exp(s_h)), o *= exp(lse - lse_total).
Masks are explicit booleans per (query segment, key segment) from the global token indices: causal,
the sliding window (i - W < j <= i) and, for packed sequences, equal document ids. Segment pairs that
the mask hides completely are skipped; pairs it shows completely run without a mask.

Collectives (P2P over the cp group, `batch_isend_irecv`, to rank+1 and from rank-1):
- forward: P-1 hops of (k, v), each overlapped with the block computed meanwhile;
- backward: P-1 hops of (k, v) again, and P hops of the fp32 (dk, dv) accumulators that travel with
  their block, so after the last hop each rank holds the full gradient of its own keys and values;
  dq stays local. With p = exp(a - lse_total) and delta_i = dO_i . O_i:
    dv_j = sum_i p_ij dO_i,   ds_ij = p_ij (dO_i . v_j - delta_i),   dq_i = scale sum_j ds_ij k_j,
    dk_j = scale sum_i ds_ij q_i,   ds_h (sink) = -sum_i exp(s_h - lse_total_i) delta_i.
Math runs in fp32 whatever the input dtype (bf16 inputs give bf16 outputs and gradients); grouped-query
heads are handled by viewing queries as (batch, kv_heads, group, len, dim). Attention dropout is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

NEG_INF = float("-inf")


@dataclass
class RingLayout:
    """Where the tokens of every cp rank sit in the global sequence.

    segments[r]: the (start, length) ranges of global token indices that rank r holds, in the order
    its local tensors concatenate them. document_ids[r]: rank r's (batch, local_len) document ids, or
    None for one document per sequence.
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    segments: list[list[tuple[int, int]]]
    document_ids: Optional[list[torch.Tensor]] = None

    def local_slices(self, rank: int) -> list[tuple[slice, int, int]]:
        """(slice into rank's local tensors, global start, length) per segment of `rank`."""
        out, offset = [], 0
        for start, length in self.segments[rank]:
            out.append((slice(offset, offset + length), start, length))
            offset += length
        return out


def block_mask(layout: RingLayout, q_rank: int, q_seg, k_rank: int, k_seg, window_size: Optional[int],
               device: torch.device) -> tuple[bool, Optional[torch.Tensor]]:
    """(active, mask) for queries of segment `q_seg` against keys of segment `k_seg` (entries of
    local_slices). mask: None when every pair is visible, else boolean (batch or 1, 1, 1, n, m)."""
    (q_sl, q0, n), (k_sl, k0, m) = q_seg, k_seg
    max_diff, min_diff = q0 + n - 1 - k0, q0 - (k0 + m - 1)  # query index minus key index
    if max_diff < 0 or (window_size is not None and min_diff >= window_size):
        return False, None
    full = min_diff >= 0 and (window_size is None or max_diff < window_size)
    mask = None
    if not full:
        diff = torch.arange(q0, q0 + n, device=device)[:, None] - torch.arange(k0, k0 + m, device=device)[None, :]
        mask = diff >= 0
        if window_size is not None:
            mask = mask & (diff < window_size)
        mask = mask[None, None, None]
    if layout.document_ids is not None:
        same_doc = layout.document_ids[q_rank][:, q_sl, None] == layout.document_ids[k_rank][:, None, k_sl]
        same_doc = same_doc[:, None, None]  # (batch, 1, 1, n, m)
        mask = same_doc if mask is None else mask & same_doc
    return True, mask


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q (b, kvh, g, n, d), k (b, kvh, 1, m, d), v (b, kvh, 1, m, dv) -> (o (b, kvh, g, n, dv), lse (b, kvh, g, n)).
    A row that sees no key gets o = 0 and lse = -inf."""
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, NEG_INF)
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = row_max.masked_fill(row_max == NEG_INF, 0.0)  # fully masked rows: exp(-inf - 0) = 0
    probs = torch.exp(logits - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, v) / denom.clamp_min(torch.finfo(denom.dtype).tiny)
    return out, (denom.log() + row_max).squeeze(-1)


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine two normalised partial results over disjoint key sets (log-sum-exp weights)."""
    new = torch.logaddexp(lse, lse_b)
    safe = new.masked_fill(new == NEG_INF, 0.0)  # rows that saw nothing yet stay (0, -inf)
    out = out * torch.exp(lse - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None]
    return out, new


def block_backward(q, k, v, d_out, lse, delta, mask, scale):
    """Gradient of one block given the final per-row lse and delta = sum(dO * O): (dq, dk, dv), fp32,
    shaped like q (b, kvh, g, n, d), k (b, kvh, m, d) and v (b, kvh, m, dv)."""
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, NEG_INF)
    probs = torch.exp(logits - lse[..., None])  # the final probabilities of this block's keys
    dv = torch.einsum("bhgnm,bhgnd->bhmd", probs, d_out)
    dlogits = probs * (torch.matmul(d_out, v.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(dlogits, k) * scale
    dk = torch.einsum("bhgnm,bhgnd->bhmd", dlogits, q) * scale
    return dq, dk, dv


class _Ring:
    """Send to the next cp rank, receive from the previous one (non-blocking)."""

    def __init__(self, layout: RingLayout):
        self.layout = layout
        if layout.size > 1:
            self.next = dist.get_global_rank(layout.group, (layout.rank + 1) % layout.size)
            self.prev = dist.get_global_rank(layout.group, (layout.rank - 1) % layout.size)

    def start(self, tensors: list[torch.Tensor], tag: int) -> _Pending:
        if self.layout.size == 1:
            return _Pending([], list(tensors))
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for i, (send, recv) in enumerate(zip(tensors, received)):
            # distinct tags keep the (k, v) and (dk, dv) streams apart where the backend matches by tag (gloo)
            ops.append(dist.P2POp(dist.isend, send, self.next, self.layout.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.layout.group, tag + i))
        return _Pending(dist.batch_isend_irecv(ops), received, keep=tensors)


class _Pending:
    def __init__(self, requests, received: list[torch.Tensor], keep: Optional[list[torch.Tensor]] = None):
        self.requests, self.received, self.keep = requests, received, keep  # keep: send buffers alive until done

    def wait(self) -> list[torch.Tensor]:
        for request in self.requests:
            request.wait()
        return self.received


KV_TAG, GRAD_TAG = 0, 8


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, heads, n, d) -> fp32 (b, kv_heads, heads // kv_heads, n, d): query head h uses kv head h // group."""
    b, heads, n, d = q.shape
    return q.float().reshape(b, kv_heads, heads // kv_heads, n, d)


def _ring_forward(layout: RingLayout, q, k, v, scale, window_size):
    """fp32 (out (b, kvh, g, n, dv), lse (b, kvh, g, n)) of the local queries against every rank's keys."""
    ring = _Ring(layout)
    qg = _grouped(q, k.shape[1])
    q_segs = layout.local_slices(layout.rank)
    outs = [qg.new_zeros(*qg.shape[:3], sl.stop - sl.start, v.shape[-1]) for sl, _, _ in q_segs]
    lses = [qg.new_full((*qg.shape[:3], sl.stop - sl.start), NEG_INF) for sl, _, _ in q_segs]
    k_cur, v_cur = k, v
    for step in range(layout.size):
        src = (layout.rank - step) % layout.size
        pending = ring.start([k_cur, v_cur], KV_TAG) if step < layout.size - 1 else None
        kf, vf = k_cur.float().unsqueeze(2), v_cur.float().unsqueeze(2)
        for i, q_seg in enumerate(q_segs):
            for k_seg in layout.local_slices(src):
                active, mask = block_mask(layout, layout.rank, q_seg, src, k_seg, window_size, q.device)
                if active:
                    o_b, lse_b = block_forward(qg[..., q_seg[0], :], kf[..., k_seg[0], :], vf[..., k_seg[0], :],
                                               mask, scale)
                    outs[i], lses[i] = merge(outs[i], lses[i], o_b, lse_b)
        if pending is not None:
            k_cur, v_cur = pending.wait()
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def _ring_backward(layout: RingLayout, q, k, v, d_out, lse, delta, scale, window_size):
    """fp32 (dq grouped like q, dk, dv) for the local queries and the local keys/values."""
    ring = _Ring(layout)
    qg = _grouped(q, k.shape[1])
    dq = torch.zeros_like(qg)
    q_segs = layout.local_slices(layout.rank)
    k_cur, v_cur, grads_in_flight = k, v, None
    for step in range(layout.size):
        src = (layout.rank - step) % layout.size
        pending_kv = ring.start([k_cur, v_cur], KV_TAG) if step < layout.size - 1 else None
        kf, vf = k_cur.float().unsqueeze(2), v_cur.float().unsqueeze(2)
        dk = torch.zeros(k_cur.shape, dtype=torch.float32, device=q.device)  # this block's share, fp32
        dv = torch.zeros(v_cur.shape, dtype=torch.float32, device=q.device)
        for q_seg in q_segs:
            qs = q_seg[0]
            for k_seg in layout.local_slices(src):
                active, mask = block_mask(layout, layout.rank, q_seg, src, k_seg, window_size, q.device)
                if not active:
                    continue
                ks = k_seg[0]
                dq_b, dk_b, dv_b = block_backward(qg[..., qs, :], kf[..., ks, :], vf[..., ks, :], d_out[..., qs, :],
                                                  lse[..., qs], delta[..., qs], mask, scale)
                dq[..., qs, :] += dq_b
                dk[:, :, ks] += dk_b
                dv[:, :, ks] += dv_b
        if grads_in_flight is not None:  # what earlier ranks accumulated for this same block
            dk_in, dv_in = grads_in_flight.wait()
            dk, dv = dk + dk_in, dv + dv_in
        grads_in_flight = ring.start([dk, dv], GRAD_TAG)  # the last hop brings each block's gradient home
        if pending_kv is not None:
            k_cur, v_cur = pending_kv.wait()
    dk, dv = grads_in_flight.wait()
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, sink_logits, layout: RingLayout, scale: float, window_size: Optional[int]):
        with torch.autocast(q.device.type, enabled=False):  # blockwise math in fp32, not autocast bf16
            out, lse = _ring_forward(layout, q, k, v, scale, window_size)
            if sink_logits is not None:
                sink = sink_logits.float().reshape(1, *lse.shape[1:3], 1)
                total = torch.logaddexp(lse, sink.expand_as(lse))
                out = out * torch.exp(lse - total)[..., None]
                lse = total
        fctx.save_for_backward(q, k, v, sink_logits, out, lse)
        fctx.layout, fctx.scale, fctx.window_size = layout, scale, window_size
        b, heads, n, _ = q.shape
        return out.reshape(b, heads, n, -1).to(q.dtype)

    @staticmethod
    def backward(fctx, grad_out):
        q, k, v, sink_logits, out, lse = fctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            d_out = grad_out.float().reshape(out.shape)
            delta = (d_out * out).sum(dim=-1)  # (b, kvh, g, n)
            # a row that saw no key and no sink has lse = -inf; +inf makes its probabilities exp(-inf) = 0
            lse_safe = lse.masked_fill(lse == NEG_INF, float("inf"))
            dq, dk, dv = _ring_backward(fctx.layout, q, k, v, d_out, lse_safe, delta, fctx.scale, fctx.window_size)
            d_sink = None
            if sink_logits is not None and fctx.needs_input_grad[3]:
                sink = sink_logits.float().reshape(1, *lse.shape[1:3], 1)
                d_sink = -(torch.exp(sink - lse_safe) * delta).sum(dim=(0, 3)).reshape(-1).to(sink_logits.dtype)
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_sink, None, None, None


@torch.compiler.disable  # P2P inside a custom Function: keep it out of compiled graphs
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RingLayout, *, scale: float,
                   window_size: Optional[int] = None, sink_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q (batch, heads, n, d), k (batch, kv_heads, n, d), v (batch, kv_heads, n, dv): this rank's tokens in
    the order of layout.segments[layout.rank]; sink_logits (heads,) or None -> (batch, heads, n, dv)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    return RingAttention.apply(q, k, v, sink_logits, layout, scale, window_size)
