"""The routed experts: E position-wise MLPs whose weights are stacked tensors (num_experts, ...).

Expert e maps its tokens x (n_e, hidden) to down_e(act(x W_gate_e^T) * (x W_up_e^T)) (gated) or
down_e(act(x W_up_e^T)), with the same activation, clamp and linear offset as the dense MLP
(GPT-OSS: quick-GeGLU clamped at 7 with offset 1). Optional biases are per expert; the dispatcher
multiplies each output row, bias included, by its routing probability.

Input rows arrive grouped by expert (tokens_per_expert[e] rows for expert e, in expert order; spare
rows after the last group run through the last expert). Computation is one grouped GEMM per matrix
(`torch._grouped_mm`, via meshtron/compat.py) for fp32/bf16/fp16 on CPU and CUDA, else (fp64, widths
whose rows are not 16-byte multiples, moe_grouped_gemm false) a loop over the experts that reads the
counts on the host; both give the same numbers. Weights stay stacked along dim 0 so expert parallelism can shard
that dim (each rank then holds num_local_experts of them and sees only their tokens: tokens_per_expert
then has one entry per local expert).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.compat import grouped_mm, grouped_mm_supported
from meshtron.nn.mlp import ACTIVATIONS, gated


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int, activation: str, *, bias: bool = False,
                 clamp_value: Optional[float] = None, linear_offset: float = 0.0, grouped: bool = True):
        super().__init__()
        self.act, is_gated = ACTIVATIONS[activation]
        if not is_gated and (clamp_value is not None or linear_offset != 0.0):
            raise ValueError(f"clamp and linear offset need a gated activation, not {activation!r}")
        self.num_experts, self.grouped = num_experts, grouped
        self.clamp_value, self.linear_offset = clamp_value, linear_offset
        E, d, f = num_experts, hidden_size, ffn_size
        # nn.Linear orientation: (experts, out, in)
        self.w_gate = nn.Parameter(torch.empty(E, f, d)) if is_gated else None
        self.w_up = nn.Parameter(torch.empty(E, f, d))
        self.w_down = nn.Parameter(torch.empty(E, d, f))
        self.b_gate = nn.Parameter(torch.zeros(E, f)) if bias and is_gated else None
        self.b_up = nn.Parameter(torch.zeros(E, f)) if bias else None
        self.b_down = nn.Parameter(torch.zeros(E, d)) if bias else None

    def init_weights(self, std: float, out_std: float) -> None:
        for w in (self.w_gate, self.w_up):
            if w is not None:
                nn.init.normal_(w, 0.0, std)
        nn.init.normal_(self.w_down, 0.0, out_std)
        for b in (self.b_gate, self.b_up, self.b_down):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor | list[int]) -> torch.Tensor:
        """x (rows, hidden) grouped by expert, tokens_per_expert (num_experts,) -> (rows, hidden). Rows past
        the last group (a dispatcher's fixed-size buffer) are spare: they run through the last expert, so
        every output row is finite, and the dispatcher gives them weight 0. A list of counts (known in
        Python, e.g. for shape tracing) always takes the loop."""
        if not isinstance(tokens_per_expert, torch.Tensor):
            return self._looped(x, list(tokens_per_expert))
        if not (self.grouped and x.shape[0] > 0 and grouped_mm_supported(x, _local(self.w_up).transpose(1, 2))):
            return self._looped(x, tokens_per_expert.tolist())  # reads the counts on the host
        offs = tokens_per_expert.cumsum(0).to(torch.int32)
        offs[-1] = x.shape[0]  # spare rows join the last group
        # the expert of every row, for the biases (the experts this call serves: its local ones under EP)
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        expert_of_row = torch.repeat_interleave(torch.arange(offs.shape[0], device=x.device), sizes,
                                                output_size=x.shape[0])
        return self._mlp(x, lambda h, w, b: _grouped_linear(h, w, b, offs, expert_of_row))

    def _looped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if counts:
            counts[-1] += x.shape[0] - sum(counts)  # spare rows join the last group
        outputs = []
        for e, rows in enumerate(x.split(counts)):
            outputs.append(self._mlp(rows, lambda h, w, b, e=e: F.linear(h, w[e], None if b is None else b[e])))
        return torch.cat(outputs) if outputs else x.new_zeros(0, self.w_down.shape[1])

    def _mlp(self, x: torch.Tensor, linear) -> torch.Tensor:
        up = linear(x, _local(self.w_up), _local(self.b_up))
        if self.w_gate is None:
            h = self.act(up)
        else:
            gate = linear(x, _local(self.w_gate), _local(self.b_gate))
            h = gated(self.act, gate, up, self.clamp_value, self.linear_offset)
        return linear(h, _local(self.w_down), _local(self.b_down))


def _local(w: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's experts: expert parallelism (meshtron/parallel/expert_parallel.py) makes the stacked
    weights DTensors sharded along dim 0; the tokens that reach this rank are for its slice only."""
    return w.to_local() if hasattr(w, "to_local") else w  # a DTensor shard; nn/ imports no distributed types


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], offs: torch.Tensor,
                    expert_of_row: torch.Tensor) -> torch.Tensor:
    """Row block g of x times w[g]^T (+ b[g]): w (experts, out, in)."""
    y = grouped_mm(x, w.transpose(1, 2), offs)
    return y if b is None else y + b[expert_of_row]
