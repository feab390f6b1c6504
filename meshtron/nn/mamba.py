"""The Mamba-2 mixer: projections, a short causal convolution, the SSD scan and a gated norm.

For input u (batch, seq, hidden), with H heads of P channels, G groups and state size N:
    z = u Wz,  x = u Wx,  B = u WB,  C = u WC,  dt = u Wdt              (H*P, H*P, G*N, G*N, H)
    [x, B, C] = silu(causal_depthwise_conv([x, B, C]))                   (kernel K over time)
    dt = clamp(softplus(dt + dt_bias), dt_limit_min, dt_limit_max),  A = -exp(A_log)
    y = SSD(x, dt, A, B, C) + D * x                                      (nn/ssd.py)
    out = (group_rmsnorm(y * silu(z)) * norm_weight) Wout                (one norm group per B/C group)
With `recompute_scan`, backward recomputes the scan's chunk matrices from its inputs instead of
keeping them (they are chunk x chunk per head and token). The projections are separate matrices (Hugging Face fuses z, x, B, C, dt into one `in_proj`, and
x, B, C into one conv; the converters concatenate) so tensor parallelism can split each by head
or group. Parameters that belong to heads or channels (A_log, D, dt_bias, the conv weights, the
norm weight) may arrive as tensor-parallel shards: the mixer uses this rank's share of them.

Init (as in Mamba-2): A = -U(1, 16) stored as A_log; D = 1; dt_bias = softplus^-1(dt) with dt
log-uniform in [dt_min, dt_max], clamped to >= dt_init_floor; conv weights U(+-1/sqrt(K)), bias 0.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtron.nn import ssd
from meshtron.nn.context import RecurrentContext, RecurrentState

A_INIT_RANGE = (1.0, 16.0)


def local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel (DTensor) parameter's local shard, differentiably; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class DepthwiseConv(nn.Module):
    """The weights of a causal depthwise convolution: weight (channels, 1, kernel), bias (channels,)."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class GatedRMSNorm(nn.Module):
    """y = rmsnorm(x * silu(z)) * weight, the RMS taken over groups of `group_size` channels."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return GatedRMSNormFunction.apply(x, z, local(self.weight), self.group_size, self.eps)


def _gated_rms(x: torch.Tensor, z: torch.Tensor, group_size: int, eps: float):
    """-> (normalised (..., groups, group_size) in >= fp32, 1/rms (..., groups, 1), silu(z), x * silu(z))."""
    compute = torch.promote_types(x.dtype, torch.float32)
    gate = F.silu(z.to(compute))
    h = x.to(compute) * gate
    g = h.view(*h.shape[:-1], -1, group_size)
    rstd = torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return g * rstd, rstd, gate, h


class GatedRMSNormFunction(torch.autograd.Function):
    """The gated norm with a backward that keeps only x, z and 1/rms (the product, its square and
    the normalised values are recomputed): three tensors of the inner width fewer per sublayer.
    With h = x silu(z), n = h r per group (r = 1/rms), y = n w:
        dn = dy w,  dw = sum dy n,  dh = r (dn - n mean_group(dn n)),
        dx = dh silu(z),  dz = dh x silu'(z),  silu'(z) = sig(z) (1 + z (1 - sig(z)))."""

    @staticmethod
    def forward(ctx, x, z, weight, group_size: int, eps: float):
        n, rstd, _, _ = _gated_rms(x, z, group_size, eps)
        ctx.save_for_backward(x, z, weight, rstd)
        ctx.group_size = group_size
        return (n.view(x.shape) * weight.to(n.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, z, weight, rstd = ctx.saved_tensors
        compute = torch.promote_types(x.dtype, torch.float32)
        gate = F.silu(z.to(compute))
        g = (x.to(compute) * gate).view(*x.shape[:-1], -1, ctx.group_size)
        n = g * rstd
        dy = dy.to(compute)
        dw = (dy * n.view(x.shape)).flatten(0, -2).sum(0)
        dn = (dy * weight.to(compute)).view(n.shape)
        dh = (rstd * (dn - n * (dn * n).mean(-1, keepdim=True))).view(x.shape)
        sig = torch.sigmoid(z.to(compute))
        dx = dh * gate
        dz = dh * x.to(compute) * sig * (1 + z.to(compute) * (1 - sig))
        return dx.to(x.dtype), dz.to(z.dtype), dw.to(weight.dtype), None, None


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], prefix: Optional[torch.Tensor],
                seq_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """x (batch, seq, channels), weight (channels, 1, K), prefix (batch, K-1, channels) or None (zeros)
    -> (out (batch, seq, channels), the inputs with the prefix in front (batch, K-1+seq, channels)).
    With seq_ids, an output never mixes inputs of another run of ids (document)."""
    batch, seq, channels = x.shape
    k = weight.shape[-1]
    if prefix is None:
        prefix = x.new_zeros(batch, k - 1, channels)
    padded = torch.cat([prefix.to(x.dtype), x], dim=1)
    if seq == 1 and seq_ids is None:  # a decode step: one window, a weighted sum (far cheaper than conv1d)
        out = torch.einsum("bkc,ck->bc", padded, weight[:, 0].to(x.dtype))[:, None]
    elif seq_ids is None:
        out = F.conv1d(padded.transpose(1, 2), weight.to(x.dtype), None, groups=channels).transpose(1, 2)
    else:  # mask every tap that reaches into an earlier document (no prefix with documents: zeros)
        ids = torch.cat([seq_ids.new_full((batch, k - 1), -1), seq_ids], dim=1)
        windows = padded.unfold(1, k, 1)  # (batch, seq, channels, K)
        keep = ids.unfold(1, k, 1) == seq_ids[:, :, None]  # (batch, seq, K)
        out = torch.einsum("blck,blk,ck->blc", windows, keep.to(x.dtype), weight[:, 0].to(x.dtype))
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out, padded


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_groups: int, state_dim: int, *,
                 layer_id: int, conv_kernel: int = 4, conv_bias: bool = True, proj_bias: bool = False,
                 chunk_size: int = 128, dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 dt_limit: tuple[float, float] = (0.0, float("inf")), norm_eps: float = 1e-5,
                 recompute_scan: bool = False):
        super().__init__()
        if num_heads % num_groups:
            raise ValueError(f"mamba_num_groups={num_groups} must divide the {num_heads} heads")
        self.layer_id = layer_id
        self.head_dim, self.state_dim, self.chunk_size = head_dim, state_dim, chunk_size
        self.heads_per_group = num_heads // num_groups
        self.dt_init = (dt_min, dt_max, dt_init_floor)
        self.dt_limit = dt_limit
        self.recompute_scan = recompute_scan
        inner, bc = num_heads * head_dim, num_groups * state_dim
        self.z_proj = nn.Linear(hidden_size, inner, bias=proj_bias)
        self.x_proj = nn.Linear(hidden_size, inner, bias=proj_bias)
        self.b_proj = nn.Linear(hidden_size, bc, bias=proj_bias)
        self.c_proj = nn.Linear(hidden_size, bc, bias=proj_bias)
        self.dt_proj = nn.Linear(hidden_size, num_heads, bias=proj_bias)
        self.conv_x = DepthwiseConv(inner, conv_kernel, conv_bias)
        self.conv_b = DepthwiseConv(bc, conv_kernel, conv_bias)
        self.conv_c = DepthwiseConv(bc, conv_kernel, conv_bias)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.norm = GatedRMSNorm(inner, head_dim * self.heads_per_group, norm_eps)
        self.out_proj = nn.Linear(inner, hidden_size, bias=proj_bias)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """Init of what is not a Linear layer: A_log, D, dt_bias, the conv and the norm."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*A_INIT_RANGE).log())
        self.D.fill_(1.0)
        dt_min, dt_max, floor = self.dt_init
        log_dt = torch.rand_like(self.dt_bias) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        dt = log_dt.exp().clamp(min=floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        for conv in (self.conv_x, self.conv_b, self.conv_c):
            bound = 1.0 / math.sqrt(conv.weight.shape[-1])
            conv.weight.uniform_(-bound, bound)
            if conv.bias is not None:
                conv.bias.zero_()
        self.norm.weight.fill_(1.0)

    def forward(self, u: torch.Tensor, ctx: RecurrentContext) -> torch.Tensor:
        batch, seq, _ = u.shape
        states = ctx.mamba_states(self.layer_id) if hasattr(ctx, "mamba_states") else None
        # Local widths come from the weights, so a tensor-parallel shard needs no rank logic.
        z = self.z_proj(u)
        xbc = torch.cat([self.x_proj(u), self.b_proj(u), self.c_proj(u)], dim=-1)
        dt = F.softplus(self.dt_proj(u).float() + local(self.dt_bias).float()).clamp(*self.dt_limit)
        if states is None:
            y = self.mix(xbc, dt, None, getattr(ctx, "document_ids", None))
        else:
            y = xbc.new_empty(batch * seq, z.shape[-1])
            for state in states:
                if state.index is None:
                    y = self.mix(xbc, dt, state, None).flatten(0, 1)
                    continue
                flat = state.index.flatten()
                rows = (*state.index.shape, -1)
                part = self.mix(xbc.flatten(0, 1)[flat].view(rows), dt.flatten(0, 1)[flat].view(rows), state, None)
                y[flat] = part.flatten(0, 1)
        return self.out_proj(self.norm(y.view(batch, seq, -1), z))

    def mix(self, xbc: torch.Tensor, dt: torch.Tensor, state: Optional[RecurrentState],
            seq_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """The sequence mixing of rows of tokens: xbc (rows, q, x + B + C channels), dt (rows, q, heads)
        -> y (rows, q, heads * head_dim): conv, SSD scan (or one recurrent step) and the D skip;
        the states after each row's last real token go to `state.store`."""
        rows, seq, _ = xbc.shape
        convs = (self.conv_x, self.conv_b, self.conv_c)
        weight = torch.cat([local(c.weight) for c in convs])
        bias = None if self.conv_x.bias is None else torch.cat([local(c.bias) for c in convs])
        prefix = state.conv if state is not None else None
        out, padded = causal_conv(xbc, weight, bias, prefix, seq_ids)
        heads = dt.shape[-1]
        inner = heads * self.head_dim
        bc = (xbc.shape[-1] - inner) // 2  # B and C: groups x state_dim each
        x, B, C = F.silu(out).split([inner, bc, bc], dim=-1)
        x = x.view(rows, seq, heads, self.head_dim)
        B, C = (t.view(rows, seq, -1, self.state_dim) for t in (B, C))
        A = -torch.exp(local(self.A_log).float())
        lengths = state.lengths if state is not None else None
        if lengths is not None:  # right padding: dt = 0 there leaves the state as the last real token left it
            dt = dt * (torch.arange(seq, device=dt.device)[None, :] < lengths[:, None])[..., None]
        if state is not None and state.ssm is not None and seq == 1:
            y, ssm_state = ssd.step(state.ssm, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
            y = y[:, None]
        else:
            initial = state.ssm if state is not None else None
            scan = ssd.chunk_scan
            if self.recompute_scan and torch.is_grad_enabled() and x.requires_grad:
                scan = functools.partial(checkpoint, ssd.chunk_scan, use_reentrant=False)
            y, ssm_state = scan(x, dt, A, B, C, self.chunk_size, initial, seq_ids)
        y = y + x * local(self.D).to(x.dtype)[:, None]
        if state is not None:
            state.store(conv_tail(padded, weight.shape[-1] - 1, lengths), ssm_state)
        return y.reshape(rows, seq, -1)


def conv_tail(padded: torch.Tensor, width: int, lengths: Optional[torch.Tensor]) -> torch.Tensor:
    """The last `width` real inputs of each row of the prefixed conv input (the next conv prefix)."""
    if lengths is None:
        return padded[:, padded.shape[1] - width:].clone()
    idx = lengths[:, None] + torch.arange(width, device=padded.device)[None, :]  # prefix offset cancels
    return padded.gather(1, idx[:, :, None].expand(-1, -1, padded.shape[-1]))
