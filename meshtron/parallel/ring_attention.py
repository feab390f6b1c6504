"""Ring attention: softmax(scale q k^T + mask [+ sink]) v over a sequence split across the `cp` ranks.

Each of the P ranks holds the queries, keys and values of its own tokens (a few contiguous segments
of the global sequence, see context_parallel.py). Key/value blocks travel around the ring so that
every rank meets every block; the rank merges the blockwise results with log-sum-exp:
    o_b = softmax(a_b) v_b,   lse_b = log sum_j exp(a_bj)            (a = scale q k^T, masked = -inf)
    lse = log(exp(lse_1) + exp(lse_2)),   o = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2
A sink logit s_h is one more block with zero value: lse_total = log(exp(lse) + exp(s_h)), o *= exp(lse - lse_total).
Masks come per (query piece, key piece) from the global token indices: causal, the sliding window
(i - W < j <= i) and, for packed sequences, equal document ids. Pairs the mask hides completely are
skipped, pairs it shows completely run without a mask, a segment against itself under a plain causal
mask runs the kernels' causal mode. Only windows and documents need a mask tensor; they cut the
segments into tiles of `RingLayout.mask_tile` tokens, so a mask covers one tile pair.

Each block runs through a fused SDPA kernel that returns lse (meshtron/compat.py: the CPU flash kernel;
flash or memory-efficient attention on CUDA), in the input dtype, with memory of its tiles only; fp32
is used for the (out, lse) merge alone. Backward hands every block the FINAL out and lse of its rows, so
the kernels' own backward gives that block's exact share of the gradient:
    p_ij = exp(a_ij - lse_total_i),  delta_i = dO_i . O_i,  dv_j = sum_i p_ij dO_i,
    ds_ij = p_ij (dO_i . v_j - delta_i),  dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i,
    ds_h (sink) = -sum_i exp(s_h - lse_total_i) delta_i.
`RingLayout.kernels = False` (or a dtype/device the kernels refuse) takes the plain fp32 math per block,
which materialises (batch, heads, n, m) fp32 logits per block: the reference path.

Collectives (P2P over the cp group, `batch_isend_irecv`, to rank+1 and from rank-1):
- forward: P-1 hops of (k, v), each overlapped with the block computed meanwhile;
- backward: P-1 hops of (k, v) again, and P hops of the fp32 (dk, dv) accumulators that travel with
  their block, so after the last hop each rank holds the full gradient of its own keys and values;
  dq stays local. Grouped-query heads are native. Attention dropout is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from meshtron.compat import sdpa_block_backward, sdpa_block_forward, sdpa_lse_supported

NEG_INF = float("-inf")


@dataclass
class RingLayout:
    """Where the tokens of every cp rank sit in the global sequence.

    segments[r]: the (start, length) ranges of global token indices that rank r holds, in the order
    its local tensors concatenate them. document_ids[r]: rank r's (batch, local_len) document ids, or
    None for one document per sequence. kernels: blocks through the fused SDPA kernels (False: the
    plain fp32 math, the reference). mask_tile: under a window or documents, masks cover tiles of this
    many queries x keys.
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    segments: list[list[tuple[int, int]]]
    document_ids: Optional[list[torch.Tensor]] = None
    kernels: bool = True
    mask_tile: int = 1024

    def local_slices(self, rank: int) -> list[tuple[slice, int, int]]:
        """(slice into rank's local tensors, global start, length) per segment of `rank`."""
        out, offset = [], 0
        for start, length in self.segments[rank]:
            out.append((slice(offset, offset + length), start, length))
            offset += length
        return out


@dataclass
class Block:
    """How one (query segment, key segment) pair is computed: `causal` for the square causal mask of a
    segment against itself (no tensor), else `mask` (bool (batch or 1, 1, n, m), True = visible) or None
    when every pair is visible."""

    causal: bool = False
    mask: Optional[torch.Tensor] = None


def block_mask(layout: RingLayout, q_rank: int, q_seg, k_rank: int, k_seg, window_size: Optional[int],
               device: torch.device) -> Optional[Block]:
    """The Block for queries of segment `q_seg` against keys of segment `k_seg` (entries of local_slices),
    or None when the mask hides every pair."""
    (q_sl, q0, n), (k_sl, k0, m) = q_seg, k_seg
    max_diff, min_diff = q0 + n - 1 - k0, q0 - (k0 + m - 1)  # query index minus key index
    if n == 0 or m == 0 or max_diff < 0 or (window_size is not None and min_diff >= window_size):
        return None
    docs = layout.document_ids
    if docs is None and q0 == k0 and n == m and (window_size is None or window_size >= n):
        return Block(causal=True)
    full = min_diff >= 0 and (window_size is None or max_diff < window_size)
    mask = None
    if not full:  # booleans only: query i sees key j when 0 <= (q0 + i) - (k0 + j) [< window]
        visible = torch.ones(n, m, dtype=torch.bool, device=device)
        mask = visible.tril(q0 - k0)
        if window_size is not None:
            mask = mask & ~visible.tril(q0 - k0 - window_size)
        mask = mask[None, None]
    if docs is not None:
        same_doc = (docs[q_rank][:, q_sl, None] == docs[k_rank][:, None, k_sl])[:, None]  # (batch, 1, n, m)
        mask = same_doc if mask is None else mask & same_doc
    return Block(mask=mask)


def _dense_mask(block: Block, n: int, m: int, device: torch.device) -> Optional[torch.Tensor]:
    if block.causal:
        return torch.ones(n, m, dtype=torch.bool, device=device).tril()[None, None]
    return block.mask


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain fp32 math of one block: fp32 q (b, kvh, g, n, d), k (b, kvh, 1, m, d), v (b, kvh, 1, m, dv),
    mask bool broadcastable to (b, kvh, g, n, m) or None -> (o (b, kvh, g, n, dv), lse (b, kvh, g, n)).
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


def block_backward(q, k, v, d_out, lse, delta, mask, scale):
    """Gradient of one block (plain fp32 math) given the final per-row lse and delta = sum(dO * O): (dq, dk, dv),
    fp32, shaped like q (b, kvh, g, n, d), k (b, kvh, m, d) and v (b, kvh, m, dv)."""
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, NEG_INF)
    probs = torch.exp(logits - lse[..., None])  # the final probabilities of this block's keys
    dv = torch.einsum("bhgnm,bhgnd->bhmd", probs, d_out)
    dlogits = probs * (torch.matmul(d_out, v.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(dlogits, k) * scale
    dk = torch.einsum("bhgnm,bhgnd->bhmd", dlogits, q) * scale
    return dq, dk, dv


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """fp32 (b, heads, n, ...) -> (b, kv_heads, heads // kv_heads, n, ...): query head h uses kv head h // group."""
    return t.float().reshape(t.shape[0], kv_heads, t.shape[1] // kv_heads, *t.shape[2:])


def _math_forward(q, k, v, mask, scale):
    """block_forward on (b, h, n, d) queries, (b, kvh, m, d) keys, mask (b or 1, 1, n, m) -> ((b, h, n, dv), (b, h, n))."""
    kv_heads = k.shape[1]
    out, lse = block_forward(_grouped(q, kv_heads), k.float().unsqueeze(2), v.float().unsqueeze(2),
                             None if mask is None else mask.unsqueeze(2), scale)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_backward(d_out, q, k, v, out, lse, mask, scale):
    """block_backward for the layouts of _math_forward, given the final out and lse of the query rows."""
    kv_heads = k.shape[1]
    d_out_g = _grouped(d_out, kv_heads)
    delta = (d_out_g * _grouped(out, kv_heads)).sum(-1)
    dq, dk, dv = block_backward(_grouped(q, kv_heads), k.float().unsqueeze(2), v.float().unsqueeze(2), d_out_g,
                                _grouped(lse, kv_heads), delta, None if mask is None else mask.unsqueeze(2), scale)
    return dq.flatten(1, 2), dk, dv


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine two normalised partial results over disjoint key sets (log-sum-exp weights)."""
    new = torch.logaddexp(lse, lse_b)
    safe = new.masked_fill(new == NEG_INF, 0.0)  # rows that saw nothing yet stay (0, -inf)
    out = out * torch.exp(lse - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None]
    return out, new


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


def _blocks(layout: RingLayout, src: int, window_size: Optional[int], device: torch.device):
    """(query slice, key slice, Block) of every pair of local query and `src` key pieces that the mask does
    not hide entirely. Under a window or documents the segments are cut into tiles of `layout.mask_tile`
    tokens first: a mask tensor then covers one tile pair (not a whole segment pair), and a window
    skips the tiles outside its band and runs those inside it unmasked."""
    tile = layout.mask_tile if window_size is not None or layout.document_ids is not None else None
    for q_seg in _tiles(layout.local_slices(layout.rank), tile):
        for k_seg in _tiles(layout.local_slices(src), tile):
            block = block_mask(layout, layout.rank, q_seg, src, k_seg, window_size, device)
            if block is not None:
                yield q_seg[0], k_seg[0], block


def _tiles(segments: list[tuple[slice, int, int]], tile: Optional[int]) -> list[tuple[slice, int, int]]:
    if tile is None:
        return segments
    return [(slice(sl.start + o, sl.start + min(o + tile, length)), start + o, min(tile, length - o))
            for sl, start, length in segments for o in range(0, length, tile)]


def _ring_forward(layout: RingLayout, q, k, v, scale, window_size, kernels: bool):
    """(out (b, h, n, dv), lse (b, h, n)), both at least fp32, of the local queries against every rank's keys."""
    ring, acc = _Ring(layout), torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], NEG_INF, dtype=acc, device=q.device)
    k_cur, v_cur = k, v
    for step in range(layout.size):
        src = (layout.rank - step) % layout.size
        pending = ring.start([k_cur, v_cur], KV_TAG) if step < layout.size - 1 else None
        for qs, ks, block in _blocks(layout, src, window_size, q.device):
            q_b, k_b, v_b = q[:, :, qs], k_cur[:, :, ks], v_cur[:, :, ks]
            if kernels:
                o_b, lse_b = sdpa_block_forward(q_b, k_b, v_b, scale=scale, is_causal=block.causal, mask=block.mask)
            else:
                o_b, lse_b = _math_forward(q_b, k_b, v_b, _dense_mask(block, q_b.shape[2], k_b.shape[2],
                                                                          q.device), scale)
            out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o_b.to(acc), lse_b.to(acc))
        if pending is not None:
            k_cur, v_cur = pending.wait()
    return out, lse


def _ring_backward(layout: RingLayout, q, k, v, d_out, out, lse, scale, window_size, kernels: bool):
    """fp32 (dq, dk, dv) for the local queries and the local keys/values. d_out, out (b, h, n, dv) and lse
    (b, h, n) are the final ones of the local queries (+inf lse for rows that see no key)."""
    ring, acc = _Ring(layout), torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur, grads_in_flight = k, v, None
    for step in range(layout.size):
        src = (layout.rank - step) % layout.size
        pending_kv = ring.start([k_cur, v_cur], KV_TAG) if step < layout.size - 1 else None
        dk = torch.zeros(k_cur.shape, dtype=acc, device=q.device)  # this block's share
        dv = torch.zeros(v_cur.shape, dtype=acc, device=q.device)
        for qs, ks, block in _blocks(layout, src, window_size, q.device):
            args = (d_out[:, :, qs], q[:, :, qs], k_cur[:, :, ks], v_cur[:, :, ks], out[:, :, qs], lse[:, :, qs])
            if kernels:
                grads = sdpa_block_backward(*args, scale=scale, is_causal=block.causal, mask=block.mask)
            else:
                grads = _math_backward(*args, _dense_mask(block, args[1].shape[2], args[2].shape[2], q.device),
                                            scale)
            dq[:, :, qs] += grads[0]
            dk[:, :, ks] += grads[1]
            dv[:, :, ks] += grads[2]
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
        kernels = layout.kernels and sdpa_lse_supported(q, k, v)
        with torch.autocast(q.device.type, enabled=False):  # the kernels in the input dtype, the merge in fp32
            out, lse = _ring_forward(layout, q, k, v, scale, window_size, kernels)
            if sink_logits is not None:
                sink = sink_logits.to(lse.dtype).reshape(1, -1, 1)
                total = torch.logaddexp(lse, sink.expand_as(lse))
                out = out * torch.exp(lse - total)[..., None]
                lse = total
        result = out.to(q.dtype)
        # the kernels' backward reads the output in the input dtype; the math path keeps its fp32 output
        fctx.save_for_backward(q, k, v, sink_logits, result if kernels else out, lse)
        fctx.layout, fctx.scale, fctx.window_size, fctx.kernels = layout, scale, window_size, kernels
        return result

    @staticmethod
    def backward(fctx, grad_out):
        q, k, v, sink_logits, out, lse = fctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            d_out = grad_out.to(out.dtype).contiguous()
            # a row that saw no key and no sink has lse = -inf; +inf makes its probabilities exp(-inf) = 0
            lse_safe = lse.masked_fill(lse == NEG_INF, float("inf"))
            dq, dk, dv = _ring_backward(fctx.layout, q, k, v, d_out, out, lse_safe, fctx.scale, fctx.window_size,
                                        fctx.kernels)
            d_sink = None
            if sink_logits is not None and fctx.needs_input_grad[3]:
                delta = (d_out.to(lse.dtype) * out.to(lse.dtype)).sum(dim=-1)  # (b, h, n)
                sink = sink_logits.to(lse.dtype).reshape(1, -1, 1)
                d_sink = -(torch.exp(sink - lse_safe) * delta).sum(dim=(0, 2)).to(sink_logits.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_sink, None, None, None


@torch.compiler.disable  # P2P inside a custom Function: keep it out of compiled graphs
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RingLayout, *, scale: float,
                   window_size: Optional[int] = None, sink_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q (batch, heads, n, d), k (batch, kv_heads, n, d), v (batch, kv_heads, n, dv): this rank's tokens in
    the order of layout.segments[layout.rank]; sink_logits (heads,) or None -> (batch, heads, n, dv)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    return RingAttention.apply(q, k, v, sink_logits, layout, scale, window_size)
