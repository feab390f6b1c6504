"""Expert parallelism: the routed experts of every MoE sublayer are split over the mesh's `ep` axis,
and each layer's token dispatcher moves hidden states to the rank that holds their expert and back.

With P = ep ranks and E experts, rank r holds experts [r E/P, (r+1) E/P): the stacked expert weights
(experts, ...) become DTensors sharded along dim 0 over `ep` (FSDP then shards each rank's slice over
the remaining data ranks, see parallel/fsdp.py). Router, shared experts and everything else stay
replicated over `ep`; every rank routes its own tokens and builds its own routing map (capacity is per
rank and micro-batch, as in one process). Two dispatchers (parallel.ep_dispatcher):

  alltoall   forward: exchange per-expert token counts (all-to-all of E integers), then one
             all-to-all of the token rows with uneven splits (rank r sends rank q the rows routed to
             q's experts), regroup the received rows expert by expert; the experts run; the inverse
             regrouping and the reverse all-to-all bring the outputs home, where they are weighted by
             their routing probabilities and summed per token.
             backward: the same two all-to-alls with the splits swapped.
  allgather  forward: all-gather the tokens and their routing probabilities over `ep` (T P rows);
             every rank runs its experts on the rows routed to them, weights and sums them per token,
             and a reduce-scatter sums the P partial outputs and returns each rank its own tokens.
             backward: reduce-scatter of the token gradients, all-gather of the output gradients.
All-to-all moves only the rows that need to move (T k (P-1)/P per rank on average); all-gather moves
T (P-1) rows in and out whatever the routing, but needs no per-expert count exchange. Each reads the
device once per forward on the host (none in backward): all-to-all its split sizes (Python ints for the
collective), all-gather the largest token count of the ranks (the size of the gathered buffer); the
routing itself is read by neither (buffers are sized by the routing map's static row bound).
Uneven numbers of tokens per rank are allowed (all-gather pads to the largest).

Expert tensor parallelism (parallel.expert_tensor_parallel, with tp > 1) also splits every expert's
ffn width over `tp`: the weights become DTensors on the 2-D (ep, tp) mesh, and the tp ranks, which
route the same replicated tokens, all-reduce their partial expert outputs (see
ExpertTensorParallelDispatcher). Without it the routed experts are replicated over tp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from meshtron.compat import grouped_mm_row_alignment
from meshtron.config.fields import ConfigError
from meshtron.nn.moe.balance import moe_layers
from meshtron.nn.moe.dispatcher import LocalDispatcher, LocalHandle, permute, unpermute
from meshtron.parallel.distributed import copy_to_group, reduce_from_group

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


# ---- collectives with autograd ----------------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """Rows split[i] of the input go to rank i; the output holds rank i's rows in rank order.
    Backward is the reverse all-to-all (the splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (input_splits, output_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), output_splits, input_splits, ctx.group), None, None, None


class _AllGather(torch.autograd.Function):
    """(n, ...) on each rank -> (P n, ...) in rank order; backward sums the gradients over the ranks
    and keeps this rank's block (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty(x.shape[0] * dist.get_world_size(group), *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ReduceScatter.apply(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    """(P n, ...) on each rank -> the sum over ranks of block `rank` (n, ...); backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty(x.shape[0] // dist.get_world_size(group), *x.shape[1:])
        dist.reduce_scatter_tensor(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllGather.apply(grad, ctx.group), None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, output_splits, input_splits, group)


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceScatter.apply(x, group)


# ---- dispatchers ----------------------------------------------------------------------------------

@dataclass
class AllToAllHandle:
    local: LocalHandle       # this rank's tokens, expert-major over all E experts
    sent: list[int]          # rows sent to each rank
    received: list[int]      # rows received from each rank
    order: Optional[torch.Tensor]  # received row of each expert-input row (None: already in order)


class AllToAllDispatcher:
    """Tokens travel to their experts' ranks with one uneven all-to-all and come back with another."""

    host_reads = 1  # the split sizes

    def __init__(self, group, num_experts: int):
        self.group, self.num_experts = group, num_experts
        self.ep_size = dist.get_world_size(group)
        self.num_local_experts = num_experts // self.ep_size

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 row_bound=None) -> tuple[torch.Tensor, torch.Tensor, AllToAllHandle]:
        P, L = self.ep_size, self.num_local_experts
        max_rows = None if row_bound is None else row_bound(tokens.shape[0])
        rows, tokens_per_expert, local = permute(tokens, probs, routing_map, max_rows)
        send_counts = tokens_per_expert.reshape(-1)                       # (P * L,) rank-major
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv_counts = recv_counts.view(P, L)                             # [source rank, local expert]
        # this dispatcher's one host read: the collective takes its split sizes as Python ints
        sent, received = torch.stack([send_counts.view(P, L).sum(1), recv_counts.sum(1)]).tolist()
        x = all_to_all(rows[:sum(sent)], received, sent, self.group)     # (M, hidden) source-major
        order = _source_to_expert_major(recv_counts, sum(received)) if P > 1 and L > 1 else None
        if order is not None:
            x = x[order]
        return x, recv_counts.sum(0), AllToAllHandle(local, sent, received, order)

    def combine(self, expert_output: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        y = expert_output
        if handle.order is not None:
            y = y.new_empty(y.shape).index_copy(0, handle.order, y)      # back to source-major
        y = all_to_all(y, handle.sent, handle.received, self.group)
        spare = handle.local.token_ids.shape[0] - y.shape[0]             # permute's spare rows: weight 0
        return unpermute(nn.functional.pad(y, (0, 0, 0, spare)) if spare else y, handle.local)


def _source_to_expert_major(counts: torch.Tensor, total: int) -> torch.Tensor:
    """counts (sources, experts), `total` rows: rows arrive in blocks ordered (source, expert); return the
    index that lists them ordered (expert, source), keeping the order within a block."""
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view_as(counts)   # block start, source-major
    sizes_em, starts_em = counts.t().reshape(-1), starts.t().reshape(-1)            # blocks in expert-major order
    offsets_em = sizes_em.cumsum(0) - sizes_em
    shift = torch.repeat_interleave(starts_em - offsets_em, sizes_em, output_size=total)
    return torch.arange(total, device=counts.device) + shift


@dataclass
class AllGatherHandle:
    local: LocalHandle   # over the gathered tokens of all ranks, this rank's experts only
    num_tokens: int      # this rank's tokens
    padded: int          # tokens per rank in the gathered buffer


class AllGatherDispatcher:
    """Every rank sees every token of its `ep` group and keeps the rows of its own experts; the
    per-token sums return by reduce-scatter."""

    host_reads = 1  # the largest token count of the ranks

    def __init__(self, group, num_experts: int):
        self.group, self.num_experts = group, num_experts
        self.ep_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_local_experts = num_experts // self.ep_size

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 row_bound=None) -> tuple[torch.Tensor, torch.Tensor, AllGatherHandle]:
        T = tokens.shape[0]
        sizes = torch.empty(self.ep_size, dtype=torch.long, device=tokens.device)
        dist.all_gather_into_tensor(sizes, torch.full((1,), T, device=tokens.device), group=self.group)
        padded = int(sizes.max())  # this dispatcher's one host read: the gathered buffer's size
        if padded > T:
            pad = padded - T
            tokens, probs = nn.functional.pad(tokens, (0, 0, 0, pad)), nn.functional.pad(probs, (0, 0, 0, pad))
            routing_map = nn.functional.pad(routing_map, (0, 0, 0, pad))      # padding rows route nowhere
        first = self.rank * self.num_local_experts
        mine = slice(first, first + self.num_local_experts)
        all_tokens = all_gather(tokens, self.group)                            # (P padded, hidden)
        all_probs = all_gather(probs, self.group)[:, mine]                     # (P padded, local experts)
        all_map = all_gather(routing_map.to(torch.uint8), self.group)[:, mine].bool()
        # every rank's map holds at most row_bound(padded) entries, and each gathered token at most one per expert
        max_rows = None if row_bound is None else self.ep_size * min(row_bound(padded), padded * self.num_local_experts)
        rows, tokens_per_expert, local = permute(all_tokens, all_probs, all_map, max_rows,
                                                 grouped_mm_row_alignment(all_tokens))
        return rows, tokens_per_expert, AllGatherHandle(local, T, padded)

    def combine(self, expert_output: torch.Tensor, handle: AllGatherHandle) -> torch.Tensor:
        partial = unpermute(expert_output, handle.local)                      # (P padded, hidden)
        return reduce_scatter(partial, self.group)[:handle.num_tokens]


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


# ---- applying it -----------------------------------------------------------------------------------

class ExpertTensorParallelDispatcher:
    """Expert tensor parallelism around another dispatcher: each tp rank holds 1/tp of every expert's
    ffn width (w_gate, w_up split along their output rows, w_down along its input columns), sees the same
    rows (tokens are replicated over tp), and computes a partial sum of each expert output. The partial
    outputs are all-reduced over tp before `combine`; the input rows' gradient is all-reduced in backward
    (Megatron's column/row-parallel pair, per expert)."""

    def __init__(self, inner, tp_group):
        self.inner, self.tp_group = inner, tp_group

    @property
    def host_reads(self):
        return getattr(self.inner, "host_reads", None)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, row_bound=None):
        rows, tokens_per_expert, handle = self.inner.dispatch(tokens, probs, routing_map, row_bound=row_bound)
        return copy_to_group(rows, self.tp_group), tokens_per_expert, handle

    def combine(self, expert_output: torch.Tensor, handle) -> torch.Tensor:
        return self.inner.combine(reduce_from_group(expert_output, self.tp_group), handle)


# ---- applying it -----------------------------------------------------------------------------------

# the dim of each stacked expert weight that expert tensor parallelism splits (the ffn width)
ETP_DIMS = {"w_gate": 1, "w_up": 1, "w_down": 2, "b_gate": 1, "b_up": 1}


def check_ep_divisibility(model: nn.Module, ep: int) -> None:
    for _, layer in moe_layers(model):
        if layer.num_experts % ep:
            raise ConfigError(f"parallel.ep: {ep} must divide model.num_moe_experts={layer.num_experts}; "
                              "change one of them")


def apply_ep(model: nn.Module, mesh: DeviceMesh, dispatcher: str = "alltoall") -> None:
    """Shard the routed experts of every MoE sublayer of `model` (a GPTModel or a pipeline stage) and
    install the dispatcher that moves their tokens. `mesh` has an "ep" axis (expert parallelism:
    dim 0 of the stacked weights split, tokens moved by `dispatcher`), a "tp" axis (expert tensor
    parallelism: the ffn width split, see ExpertTensorParallelDispatcher), or both.
    Every rank must hold the same full weights before (they are built from one seed)."""
    if dispatcher not in DISPATCHERS:
        raise ConfigError(f"parallel.ep_dispatcher: {dispatcher!r} is not allowed; choose one of "
                          f"{', '.join(DISPATCHERS)}")
    names = mesh.mesh_dim_names
    assert set(names) <= {"ep", "tp"} and names, names
    if "ep" in names:
        check_ep_divisibility(model, mesh["ep"].size())
    if "tp" in names:
        check_etp(model, mesh["tp"].size())
    for _, layer in moe_layers(model):
        experts = layer.experts
        for name in EXPERT_WEIGHTS:
            weight = getattr(experts, name, None)
            if weight is not None:
                placements = [Shard(0) if axis == "ep" else (Shard(ETP_DIMS[name]) if name in ETP_DIMS else Replicate())
                              for axis in names]
                setattr(experts, name, nn.Parameter(distribute_tensor(weight.data, mesh, placements),
                                                    requires_grad=weight.requires_grad))
        inner = DISPATCHERS[dispatcher](mesh["ep"].get_group(), layer.num_experts) if "ep" in names else LocalDispatcher()
        layer.dispatcher = ExpertTensorParallelDispatcher(inner, mesh["tp"].get_group()) if "tp" in names else inner


def check_etp(model: nn.Module, tp: int) -> None:
    for _, layer in moe_layers(model):
        ffn = layer.experts.w_up.shape[1]
        if ffn % tp:
            raise ConfigError(f"parallel.expert_tensor_parallel: tp={tp} must divide the expert width {ffn} "
                              "(model.moe_ffn_hidden_size); change one of them or set it false")
        if layer.experts.b_down is not None:
            raise ConfigError("parallel.expert_tensor_parallel: expert biases (model.add_bias_linear) are not "
                              "supported with expert tensor parallelism; set it false (experts then replicate over tp)")
