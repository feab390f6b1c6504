"""Optimizer offload moves memory the way offload needs: host buffers allocated pinned on CUDA,
one device -> host gradient copy per parameter per step whatever the number of micro-batches, and a
resume that loads host states into host memory without passing them through the device."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.training import Trainer, offload
from meshtron.training.offload import OffloadOptimizer

COMMON = {"train.train_iters": "3", "scheduler.decay_steps": "3", "checkpoint.save_at_end": "false",
          "optimizer.lr": "3e-3", "optimizer.clip_grad": "0", "optimizer.offload_fraction": "1.0"}


class CopiesInto(TorchDispatchMode):
    """Counts aten copy_ calls whose destination is one of the given tensors (by storage address)."""

    def __init__(self, targets: list[torch.Tensor]):
        super().__init__()
        self.addresses, self.count = {t.data_ptr() for t in targets}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].data_ptr() in self.addresses:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_one_gradient_copy_per_parameter_per_step(tiny_config, micro_batches):
    """The hooks used to copy every micro-batch's accumulation (2 or 4 copies per step); now only the
    last micro-batch's backward copies, so the count is the same for 2 and 4 micro-batches."""
    trainer = Trainer(tiny_config(**COMMON, **{"train.global_batch_size": str(2 * micro_batches)}))
    buffers = [h.grad_buffer for h in trainer.optimizer.host.values()]
    with CopiesInto(buffers) as counter:
        trainer.train()
    assert counter.count == 3 * len(buffers)   # 3 steps, each host parameter once
    assert trainer.optimizer.copy_counts == {"in_backward": 3 * len(buffers), "at_step": 0}


def test_host_buffers_are_allocated_pinned_when_asked(monkeypatch):
    """torch.empty_like of a pinned tensor is pageable: the gradient buffer must be asked for pinned
    itself. (The CPU build cannot pin; the request is recorded instead, the CUDA test checks is_pinned.)"""
    asked = []
    real_empty = torch.empty

    def recording_empty(*args, pin_memory=False, **kwargs):
        asked.append(pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(offload.torch, "empty", recording_empty)
    host = offload._HostParam(torch.nn.Parameter(torch.randn(4, 3)), pin=True)
    assert asked == [True, True]                     # master copy and gradient buffer
    assert host.master.shape == host.grad_buffer.shape == (4, 3)
    asked.clear()
    offload._HostParam(torch.nn.Parameter(torch.randn(2)), pin=False)
    assert asked == [False, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_buffers_are_pinned_on_cuda():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)).cuda()
    opt = OffloadOptimizer([{"params": list(model.parameters())}], torch.optim.AdamW, {"lr": 1e-3}, 1.0)
    model(torch.randn(4, 16, device="cuda")).sum().backward()
    opt.step()
    for h in opt.host.values():
        assert h.master.is_pinned() and h.grad_buffer.is_pinned()
        assert all(v.is_pinned() for v in opt.state[h.param].values() if v.dim() > 0)


def test_resume_loads_host_states_without_the_device_path(tiny_config, tmp_path, monkeypatch):
    """The base class's load_state_dict casts every state to its parameter's device (the GPU): host
    states must not reach it. The resumed run still equals the straight one (exact on the CPU)."""
    offload_cfg = {**COMMON, "optimizer.offload_fraction": "0.6", "scheduler.decay_steps": "6"}
    straight = Trainer(tiny_config(**{**offload_cfg, "train.train_iters": "6"})).train()
    Trainer(tiny_config(**{**offload_cfg, "checkpoint.save_at_end": "true",
                           "checkpoint.save": str(tmp_path / "ck")})).train()
    seen = []
    base_load = torch.optim.Optimizer.load_state_dict

    def spy(self, state_dict):
        if isinstance(self, OffloadOptimizer):
            seen.append(set(state_dict["state"]))
        return base_load(self, state_dict)

    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", spy)
    resumed = Trainer(tiny_config(**{**offload_cfg, "train.train_iters": "6", "checkpoint.load": str(tmp_path / "ck")}))
    opt = resumed.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    host_indices = {i for i, p in enumerate(params) if id(p) in opt.host}
    assert seen and host_indices and all(not (indices & host_indices) for indices in seen)
    assert len(seen[-1]) == len(params) - len(host_indices)   # the device states did go through it
    for h in opt.host.values():
        assert all(v.device.type == "cpu" for v in opt.state[h.param].values())
    assert [r.loss for r in resumed.train()] == [r.loss for r in straight][3:]
