"""Forward-only pipeline pass for evaluation, for any stage placement and any number of micro-batches.

Breadth-first: each rank runs its stages in stage order, each over all micro-batches. A stage takes
its inputs from the previous stage held on this rank, or receives them from the rank that holds
it; it sends its outputs on with non-blocking sends. Every dependency points to a higher stage
index and sends never block, so no rank waits on one that is waiting on it. (torch's ZB-V schedule
cannot run without a backward, and the others constrain the micro-batch count: this pass serves
all of them.) A hidden state crossing ranks is preceded by a header with its shape and dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def forward_only(parts: list[nn.Module], stage_ids: list[int], num_stages: int, rank_of: Callable[[int], int],
                 group: dist.ProcessGroup, device: torch.device, batches: list[dict[str, torch.Tensor]],
                 inputs_of: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                 on_logits: Callable[[torch.Tensor, int], None]) -> None:
    """Run this rank's stages over `batches`; the last stage hands (logits, micro-batch index) to
    `on_logits`. `inputs_of(mb)` gives a stage's keyword inputs (positions, document ids)."""
    held: list[torch.Tensor] | None = None  # outputs of the previous stage when it is on this rank
    for part, s in zip(parts, stage_ids):
        outputs, pending = [], []
        for i, mb in enumerate(batches):
            if s == 0:
                x = mb["input_ids"]
            elif held is not None:
                x = held[i]
            else:
                x = _recv_hidden(rank_of(s - 1), s, group, device)
            y = part(x, **inputs_of(mb))
            if s == num_stages - 1:
                on_logits(y, i)
            elif s + 1 in stage_ids:
                outputs.append(y)
            else:
                pending += _send_hidden(y, rank_of(s + 1), s + 1, group)
        for work, _ in pending:
            work.wait()
        held = outputs or None


def _send_hidden(h: torch.Tensor, peer: int, tag: int, group) -> list[tuple[dist.Work, torch.Tensor]]:
    """Non-blocking send of header and payload; the tensors are kept alive with their work handles."""
    assert isinstance(h, torch.Tensor) and type(h) is torch.Tensor and h.dim() == 3, "stages pass local 3-D tensors"
    h = h.contiguous()
    header = torch.tensor([*h.shape, DTYPES.index(h.dtype)], dtype=torch.int64, device=h.device)
    return [(dist.isend(t, group=group, group_dst=peer, tag=tag), t) for t in (header, h)]


def _recv_hidden(peer: int, tag: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(4, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=peer, tag=tag)
    batch, seq, hidden, dtype = header.tolist()
    h = torch.empty(batch, seq, hidden, dtype=DTYPES[dtype], device=device)
    dist.recv(h, group=group, group_src=peer, tag=tag)
    return h

