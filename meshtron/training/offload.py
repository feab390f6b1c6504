"""Optimizer CPU offload: the states of a chosen fraction of the parameters live in host memory
(pinned on CUDA) and step on the CPU; the other parameters step on the device as usual.

The host part of a step: gradients device -> host into host buffers, the CPU optimizer steps on
host copies of those parameters, the new values host -> device. With overlap, each host parameter's
gradient copy starts during backward of the step's last micro-batch (one copy per step), from a
post-accumulate-grad hook (on CUDA queued on a side stream after the gradient is ready, into pinned
buffers so that the copy is asynchronous; on the CPU a plain copy); at the step a copy is used if the
gradient has not changed since (same tensor, same version: no later micro-batch accumulated into it,
clipping did not scale it), else it is copied again, so results do not depend on it. Parameters
managed by FSDP/HSDP (DTensors on a data-parallel mesh axis) copy at the step only: their gradient
shards are written by collectives, which autograd's version counter does not see. On CUDA the host parameters are also cut into chunks, each with its own CPU
optimizer: the remaining gradient copies are queued on the side stream with an event per chunk,
and chunk i steps as soon as its event completes, while later chunks are still arriving, earlier
ones are already copying back, and the device optimizer runs on the GPU. Each parameter's update is the same arithmetic as the device
optimizer's, so results match it (bit for bit when the device is the CPU).

This is one `torch.optim.Optimizer` over the model's own parameters: the trainer sets the learning
rate on `param_groups`, and checkpoints see per-parameter state keyed by the model's parameters (the
host states are the very dicts the CPU optimizers update). Host copies are refreshed from the model
whenever a parameter changed outside this optimizer (a checkpoint load writes into it); loaded host
states go straight into host memory, never through the device.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from meshtron.compat import tensor_version


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) parameter or gradient, as a view."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(param: torch.Tensor, in_backward: bool = False) -> Optional[torch.Tensor]:
    """This rank's part of param's gradient in the parameter's own layout (a tensor-parallel gradient
    may be Replicate where the parameter is Shard). In backward only a gradient already in that layout
    is taken (None otherwise: redistributing could need a collective there)."""
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        if in_backward:
            return None
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)


class _HostParam:
    """A parameter whose optimizer state is on the host: its host copy (with a gradient buffer)."""

    def __init__(self, param: torch.nn.Parameter, pin: bool):
        self.param = param
        value = local(param).detach()
        # allocated pinned (empty_like of a pinned tensor is not pinned): a non_blocking copy from or to
        # pageable memory is synchronous, which would serialise backward with the copies
        self.master = host_empty(value, pin).copy_(value)
        self.grad_buffer = host_empty(value, pin)
        self.seen = self._fingerprint()
        self.copied: Optional[tuple[torch.Tensor, int]] = None   # (the gradient, its version) copied in backward

    def copy_is_current(self) -> bool:
        """True if grad_buffer holds (or is queued to receive) the parameter's gradient as it is now."""
        grad = self.param.grad
        return self.copied is not None and grad is self.copied[0] and tensor_version(local(grad)) == self.copied[1]

    def _fingerprint(self) -> tuple[int, int]:
        data = local(self.param)
        return data.data_ptr(), tensor_version(data)

    def refresh_if_changed(self) -> None:
        if self._fingerprint() != self.seen:
            self.master.copy_(local(self.param).detach())
            self.seen = self._fingerprint()

    def copy_back(self, non_blocking: bool) -> None:
        local(self.param).detach().copy_(self.master, non_blocking=non_blocking)

    def mark_written(self) -> None:
        self.seen = self._fingerprint()


class OffloadOptimizer(torch.optim.Optimizer):
    def __init__(self, param_groups: list[dict], optimizer_class: type, optimizer_kwargs: dict[str, Any],
                 fraction: float, overlap: bool = True, num_chunks: int = 4):
        # the class's full defaults (amsgrad, foreach, ...), so checkpoints match the plain optimizer's keys
        defaults = optimizer_class([torch.zeros(1)], **optimizer_kwargs).defaults
        super().__init__(param_groups, dict(defaults))
        self.optimizer_class, self.optimizer_kwargs = optimizer_class, dict(optimizer_kwargs)
        params = [p for g in self.param_groups for p in g["params"]]
        on_cuda = bool(params) and local(params[0]).device.type == "cuda"
        self.overlap, self.pin = overlap and on_cuda, on_cuda
        host_ids = _choose_host(params, fraction)
        self.host = {id(p): _HostParam(p, pin=on_cuda) for p in params if id(p) in host_ids}
        self.device_optimizer = self._inner([[p for p in g["params"] if id(p) not in host_ids]
                                             for g in self.param_groups])
        chunks = _chunks([self.host[id(p)] for p in params if id(p) in host_ids], num_chunks if self.overlap else 1)
        self.chunks: list[tuple[Optional[torch.optim.Optimizer], list[_HostParam]]] = []
        for chunk in chunks:
            members = {id(h.param) for h in chunk}
            groups = [[self.host[id(p)].master for p in g["params"] if id(p) in members] for g in self.param_groups]
            self.chunks.append((self._inner(groups), chunk))
        self._stream = torch.cuda.Stream(device=local(params[0]).device) if self.overlap else None
        # gradient copies start in backward (both devices when overlap is asked for; exercised on the CPU)
        self.copy_in_backward = overlap
        # the hooks copy in the backward of a step's last micro-batch only (the trainer says which one
        # is; earlier copies would be superseded by the next accumulation). True unless told otherwise.
        self.last_micro_batch = True
        self.copy_counts = {"in_backward": 0, "at_step": 0}   # host gradients used per origin, for tests
        if self.copy_in_backward:
            for h in self.host.values():
                if _reduced_by_autograd_only(h.param):
                    h.param.register_post_accumulate_grad_hook(self._copy_in_backward)

    def _inner(self, groups: list[list[torch.Tensor]]) -> Optional[torch.optim.Optimizer]:
        """An optimizer of the configured class over `groups[i]` (group i's parameters); None if empty."""
        inner = [{"params": ps, "group_index": i} for i, ps in enumerate(groups) if ps]
        return self.optimizer_class(inner, **self.optimizer_kwargs) if inner else None

    # ---- the step ------------------------------------------------------------------------------

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in [self.device_optimizer, *(opt for opt, _ in self.chunks)] if o is not None]

    def _sync_hyperparameters(self) -> None:
        for opt in self._inner_optimizers():
            for group in opt.param_groups:
                source = self.param_groups[group["group_index"]]
                group.update({k: v for k, v in source.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        for _, chunk in self.chunks:
            for h in chunk:
                h.refresh_if_changed()
        if self.overlap:
            self._step_overlapped()
        else:
            if self.device_optimizer is not None:
                self.device_optimizer.step()
            for opt, chunk in self.chunks:
                self._gradients_to_host(chunk, non_blocking=False)
                opt.step()
                for h in chunk:
                    h.copy_back(non_blocking=False)
                    h.mark_written()
        self._link_state()
        return loss

    def set_last_micro_batch(self, last: bool) -> None:
        """The trainer says whether the coming backward is the step's last: gradient copies start only
        then (one device -> host copy per parameter per step, whatever the number of micro-batches)."""
        self.last_micro_batch = last

    def _copy_in_backward(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: start this parameter's gradient copy to the host now. Copies in the
        last micro-batch only; clipping changes the version afterwards and the step copies again."""
        if not self.last_micro_batch:
            return
        h = self.host[id(param)]
        grad = local_grad(param, in_backward=True)
        if grad is None:
            return
        if self._stream is None:
            h.grad_buffer.copy_(grad)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(self._stream):
                h.grad_buffer.copy_(grad, non_blocking=True)
            grad.record_stream(self._stream)
        h.copied = (param.grad, tensor_version(grad))

    def _gradients_to_host(self, chunk: list[_HostParam], non_blocking: bool) -> None:
        for h in chunk:
            if h.param.grad is None:
                h.master.grad, h.copied = None, None  # an unused parameter: the optimizer skips it, as on the device
                continue
            if h.copy_is_current():
                self.copy_counts["in_backward"] += 1
            else:   # on CUDA queued on the side stream after any copy the hook queued into the same buffer
                h.grad_buffer.copy_(local_grad(h.param), non_blocking=non_blocking)
                self.copy_counts["at_step"] += 1
            h.copied = None
            h.master.grad = h.grad_buffer

    def _step_overlapped(self) -> None:
        stream, main = self._stream, torch.cuda.current_stream()
        stream.wait_stream(main)  # gradients are final (clipped) on the main stream
        arrived = []
        with torch.cuda.stream(stream):
            for _, chunk in self.chunks:
                self._gradients_to_host(chunk, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                arrived.append(event)
        if self.device_optimizer is not None:
            self.device_optimizer.step()  # queued on the GPU; runs while the CPU steps below
        for (opt, chunk), event in zip(self.chunks, arrived):
            event.synchronize()
            opt.step()
            with torch.cuda.stream(stream):
                for h in chunk:
                    h.copy_back(non_blocking=True)
        main.wait_stream(stream)  # the next forward reads the new values
        for _, chunk in self.chunks:
            for h in chunk:
                h.mark_written()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for h in self.host.values():
            h.copied = None   # (a skipped step never reached _gradients_to_host) frees the old gradient

    # ---- state, shared with the inner optimizers -----------------------------------------------

    def _link_state(self) -> None:
        """self.state[p] is the inner optimizer's own state dict of p (or of p's host copy)."""
        if self.device_optimizer is not None:
            for p, s in self.device_optimizer.state.items():
                self.state[p] = s
        for opt, chunk in self.chunks:
            for h in chunk:
                if h.master in opt.state:
                    self.state[h.param] = opt.state[h.master]

    def state_dict(self) -> dict[str, Any]:
        """Host states take their parameter's layout (a DTensor shard stays a shard), so checkpoints
        written with offload load under any layout, with or without offload."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for index, state in list(sd["state"].items()):
            p = params[index]
            if id(p) in self.host and isinstance(p, DTensor):
                sd["state"][index] = {k: _as_layout_of(v, p) for k, v in state.items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Host states go straight to host buffers: handing them to the base class would first cast
        them to their parameter's device, allocating on the GPU exactly the memory offload saves."""
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = dict(zip(saved, (p for g in self.param_groups for p in g["params"])))   # as the base class maps them
        host_states = {i: s for i, s in state_dict["state"].items() if id(params[i]) in self.host}
        device_part = {**state_dict, "state": {i: s for i, s in state_dict["state"].items() if i not in host_states}}
        super().load_state_dict(device_part)   # casts the device states to each parameter's device
        self.state = defaultdict(dict, self.state)
        for i, state in host_states.items():
            self.state[params[i]] = dict(state)
        if self.device_optimizer is not None:
            self.device_optimizer.state = defaultdict(dict)
            for g in self.device_optimizer.param_groups:
                for p in g["params"]:
                    if p in self.state:
                        self.device_optimizer.state[p] = self.state[p]
        for opt, chunk in self.chunks:
            opt.state = defaultdict(dict)
            for h in chunk:
                if h.param in self.state:
                    moved = {k: _to_host(v, self.pin) if torch.is_tensor(v) and v.dim() > 0 else v
                             for k, v in self.state[h.param].items()}
                    opt.state[h.master] = moved
                    self.state[h.param] = moved

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state per place, and of the host copies and gradient buffers."""
        out = {"device": 0, "host": 0, "host_buffers": 0}
        for p, state in self.state.items():
            where = "host" if id(p) in self.host else "device"
            out[where] += sum(_nbytes(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        out["host_buffers"] = sum(_nbytes(h.master) + _nbytes(h.grad_buffer) for h in self.host.values())
        return out


def _reduced_by_autograd_only(p: torch.Tensor) -> bool:
    """A plain parameter, or one sharded over tensor/expert-parallel axes only: its final gradient is
    what autograd accumulates (no data-parallel reduction writes into it afterwards)."""
    if not isinstance(p, DTensor):
        return True
    names = p.device_mesh.mesh_dim_names
    return names is not None and set(names) <= {"tp", "ep"}


def _nbytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def host_empty(like: torch.Tensor, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor of like's shape and dtype, allocated pinned when `pin`."""
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)


def _to_host(v: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of v's local part, copied once from wherever v is (never through the device)."""
    t = local(v).detach()
    return host_empty(t, pin).copy_(t)


def _as_layout_of(v: Any, p: DTensor) -> Any:
    if torch.is_tensor(v) and not isinstance(v, DTensor) and v.dim() > 0 and v.shape == local(p).shape:
        return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return v


def _choose_host(params: list[torch.Tensor], fraction: float) -> set[int]:
    """The first parameters in model order whose local sizes add up to `fraction` of the total."""
    if fraction <= 0:
        return set()
    total = sum(local(p).numel() for p in params)
    chosen, count = set(), 0
    for p in params:
        if count >= fraction * total:
            break
        chosen.add(id(p))
        count += local(p).numel()
    return chosen


def _chunks(items: list[_HostParam], num_chunks: int) -> list[list[_HostParam]]:
    """Consecutive runs of about equal size (by elements)."""
    if not items:
        return []
    total = sum(h.master.numel() for h in items)
    out, current, size = [], [], 0
    for h in items:
        current.append(h)
        size += h.master.numel()
        if size >= total * (len(out) + 1) / num_chunks and len(out) < num_chunks - 1:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out
