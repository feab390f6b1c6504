"""RL under tensor parallelism: vocabulary-parallel log probs and entropy of the trainer, and the
rollout engine running the sharded model (the same parameters) on every rank of a TP group.

Log probs. The output head is column parallel with its logits left sharded over the vocabulary
(DTensor Shard(-1)): rank r holds z[..., r V/tp : (r + 1) V/tp]. With m the row max (all-reduce
max, no gradient: the result does not depend on it), s = sum_r sum_v exp(z_v - m) (all-reduce sum),
lse = m + log s, the chosen token's logit z_y found on the one rank that holds y (others add 0,
all-reduce sum): log p(y) = z_y - lse; entropy H = lse - sum_v p_v z_v (all-reduce sum). No rank
ever holds the full vocabulary. Every rank computes the same replicated loss, so the reductions are
"all-reduce forward, identity backward" (each rank's local logits get the gradient of the one loss).

Rollouts. TP rank 0 of each data-parallel replica runs the engine's scheduler and sampling on the
sharded model (its logits gathered for sampling); every step it broadcasts the step's chunks and the
other TP ranks run the same sharded forward (`meshtron.inference.tp_serving` does the same for
serving). After the generation the leader broadcasts a stop and then the generations, so every TP rank
trains on the same rollouts. Suspend/resume run on every rank locally (each frees its own shard of
the KV cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


class _SumReplicated(torch.autograd.Function):
    """All-reduce sum in forward; identity in backward (the loss downstream is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _local_shard(logits: DTensor) -> tuple[torch.Tensor, Any, int]:
    """-> (local logits (..., V/tp) in fp32, the TP group, the first vocabulary id of this shard)."""
    mesh = logits.device_mesh
    assert mesh.ndim == 1 and logits.placements[0].is_shard(logits.ndim - 1), "logits sharded over the vocabulary"
    local = logits.to_local().float()
    vocab, tp = logits.shape[-1], mesh.size()
    assert vocab % tp == 0 and local.shape[-1] == vocab // tp
    return local, mesh.get_group(), mesh.get_local_rank() * local.shape[-1]


def vocab_parallel_log_probs(logits: DTensor, labels: torch.Tensor, temperature: float = 1.0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy) under softmax(logits / temperature), each (...) and replicated."""
    local, group, first = _local_shard(logits)
    z = local / temperature
    with torch.no_grad():
        m = z.max(-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = z - m[..., None]
    lse = m + _SumReplicated.apply(shifted.exp().sum(-1), group).log()
    mine = (labels >= first) & (labels < first + z.shape[-1])
    picked = z.gather(-1, (labels - first).clamp(0, z.shape[-1] - 1)[..., None].long())[..., 0]
    label_logit = _SumReplicated.apply(picked * mine, group)
    p = (z - lse[..., None]).exp()
    expected_z = _SumReplicated.apply((p * z).sum(-1), group)
    return label_logit - lse, lse - expected_z


@contextlib.contextmanager
def gathered_logits(model: nn.Module) -> Iterator[None]:
    """Inside, the model's vocabulary-sharded logits come out whole (the engine samples from them)."""
    def gather(module, args, out):
        return out.full_tensor() if isinstance(out, DTensor) else out

    handle = model.register_forward_hook(gather)
    try:
        yield
    finally:
        handle.remove()


class TensorParallelEngineBackend:
    """`EngineBackend` for a tensor-parallel model: the TP leader generates, the others follow."""

    def __init__(self, model: nn.Module, tokenizer, config, tp_group, leader_rank: int,
                 record_routing: bool = False):
        from meshtron.rl.inference import EngineBackend

        self.model, self.group, self.leader = model, tp_group, leader_rank
        self.is_leader = dist.get_rank() == leader_rank
        # the leader records MoE routing; the followers' routers see the same replicated inputs
        self.inner = EngineBackend(model, tokenizer, config, record_routing=record_routing)
        self.engine = self.inner.engine
        self.recorder = self.inner.recorder

    def _broadcast(self, kind: str, payload: Any = None) -> None:
        dist.broadcast_object_list([(kind, payload)], src=self.leader, group=self.group)

    def generate(self, prompts, sampling):
        self.resume()
        if self.is_leader:
            self.engine.step_hook = self._broadcast
            try:
                with gathered_logits(self.model):
                    result: Any = self.inner.generate(prompts, sampling)
            except Exception as e:  # the followers must not wait for generations that never come
                result = RuntimeError(f"tensor-parallel rollout failed on the leader: {type(e).__name__}: {e}")
            finally:
                self.engine.step_hook = None
                self._broadcast("stop")
            box: list[Optional[Any]] = [result]
        else:
            self._follow()
            box = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def _follow(self) -> None:
        """Run the leader's forwards until it says stop."""
        was_training = self.model.training
        self.model.eval()
        try:
            with gathered_logits(self.model):
                while True:
                    message: list[Any] = [None]
                    dist.broadcast_object_list(message, src=self.leader, group=self.group)
                    kind, payload = message[0]
                    if kind == "step":
                        self.engine.runner.forward_only(payload)
                    elif kind == "stop":
                        return
        finally:
            self.model.train(was_training)

    def suspend(self) -> None:
        self.engine.suspend()

    def resume(self) -> None:
        if self.engine.is_suspended:
            self.engine.resume()
