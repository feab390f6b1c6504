"""Per-request recurrent state of Mamba sublayers for the engine: what it is, where it lives, who owns it.

Attention keeps one key/value row per token in paged blocks; a Mamba sublayer keeps, per request,
a fixed-size state whatever the length: the last conv_kernel - 1 inputs of its convolution and the
SSM state (heads x head_dim x state_dim). So a hybrid model's request holds KV blocks for its
attention layers and one *state slot*: slot s of every Mamba layer's tensors.

- `MambaInferenceStateConfig.from_model`: the Mamba layers and their per-request state shapes (this
  rank's share under tensor parallelism), and the bytes one slot costs.
- `StateSlotPool` (scheduler side): a slot per running request, taken when it is scheduled, given
  back when it finishes or is preempted (a preempted request recomputes from its tokens).
- `MambaStateCache` (runner side): the tensors, (num_slots + 1, ...) per layer; the last slot is
  scratch.
- `MambaStepGroups`: for one step of a packed batch, the sequences grouped so each group is one
  batched scan: all single-token chunks together (the recurrent step), each longer chunk alone
  (the chunked scan, continuing from its slot's state, so chunked prefill equals one prefill).
  A chunk that starts at position 0 starts from a zero state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from meshtron.nn.context import RecurrentState

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass(frozen=True)
class MambaInferenceStateConfig:
    pattern: str  # the model's layer types, one symbol per sublayer
    layer_ids: tuple[int, ...]  # sublayers with a recurrent state (the 'M' ones)
    conv_shape: tuple[int, int]  # (conv_kernel - 1, channels) per request and layer
    ssm_shape: tuple[int, int, int]  # (heads, head_dim, state_dim) per request and layer
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model: nn.Module) -> Optional[MambaInferenceStateConfig]:
        """None for a model without Mamba sublayers."""
        layers = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
        mixers = [(i, layer.mixer) for i, layer in enumerate(layers) if getattr(layer, "symbol", None) == "M"]
        if not mixers:
            return None
        mixer = mixers[0][1]
        channels = sum(_local(c.weight).shape[0] for c in (mixer.conv_x, mixer.conv_b, mixer.conv_c))
        kernel = mixer.conv_x.weight.shape[-1]
        heads = _local(mixer.A_log).shape[0]
        dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)  # the scan runs in >= fp32
        return cls(pattern="".join(getattr(layer, "symbol", "?") for layer in layers),
                   layer_ids=tuple(mixer.layer_id for _, mixer in mixers), conv_shape=(kernel - 1, channels),
                   ssm_shape=(heads, mixer.head_dim, mixer.state_dim), dtype=dtype)

    @property
    def bytes_per_request(self) -> int:
        per_layer = self.conv_shape[0] * self.conv_shape[1] + self.ssm_shape[0] * self.ssm_shape[1] * self.ssm_shape[2]
        return len(self.layer_ids) * per_layer * torch.empty((), dtype=self.dtype).element_size()


class StateSlotPool:
    """Slot ids 0..num_slots-1 handed to requests; each request holds at most one."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self.slot_of: dict[str, int] = {}

    def acquire(self, req_id: str) -> Optional[int]:
        """The request's slot (a new one if it has none), or None when every slot is taken."""
        if req_id not in self.slot_of:
            if not self.free_slots:
                return None
            self.slot_of[req_id] = self.free_slots.pop()
        return self.slot_of[req_id]

    def release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    @property
    def num_free(self) -> int:
        return len(self.free_slots)


class MambaStateCache:
    """conv (num_slots + 1, kernel - 1, channels) and ssm (num_slots + 1, heads, head_dim, state_dim) per
    Mamba layer; slot num_slots is scratch."""

    def __init__(self, cfg: MambaInferenceStateConfig, num_slots: int, device: torch.device):
        self.cfg, self.num_slots, self.device = cfg, num_slots, device
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (conv, ssm) tensors, allocated on first use (again after `release`)."""
        if layer_id not in self.conv:
            shape = (self.num_slots + 1,)
            self.conv[layer_id] = torch.zeros(*shape, *self.cfg.conv_shape, dtype=self.cfg.dtype, device=self.device)
            self.ssm[layer_id] = torch.zeros(*shape, *self.cfg.ssm_shape, dtype=self.cfg.dtype, device=self.device)
        return self.conv[layer_id], self.ssm[layer_id]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.conv, self.ssm) for t in d.values())

    def release(self) -> None:
        self.conv.clear()
        self.ssm.clear()


@dataclass
class StateGroup:
    index: torch.Tensor  # (rows, q) token indices in the packed row
    slots: torch.Tensor  # (rows,) state slot of each row
    fresh: Optional[torch.Tensor]  # (rows,) True where the row starts at position 0 (zero state); None: none do


@dataclass
class MambaStepGroups:
    groups: list[StateGroup]
    cache: MambaStateCache

    @classmethod
    def build(cls, chunks, starts: list[int], cache: MambaStateCache) -> MambaStepGroups:
        """`starts[i]`: where chunk i's tokens begin in the packed row."""
        device = cache.device
        singles = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        groups = []
        if singles:
            fresh = [chunks[i].start_pos == 0 for i in singles]
            groups.append(StateGroup(torch.tensor([[starts[i]] for i in singles], device=device),
                                     torch.tensor([chunks[i].state_slot for i in singles], device=device),
                                     torch.tensor(fresh, device=device) if any(fresh) else None))
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            if n > 1:
                groups.append(StateGroup(torch.arange(starts[i], starts[i] + n, device=device)[None],
                                         torch.tensor([c.state_slot], device=device),
                                         torch.tensor([True], device=device) if c.start_pos == 0 else None))
        assert all(c.state_slot >= 0 for c in chunks), "every chunk of a model with Mamba layers needs a state slot"
        return cls(groups, cache)

    def states(self, layer_id: int) -> list[RecurrentState]:
        conv_cache, ssm_cache = self.cache.layer(layer_id)
        out = []
        for g in self.groups:
            if g.fresh is not None and bool(g.fresh.all()):
                conv = ssm = None  # every row starts from zero
            else:
                conv, ssm = conv_cache.index_select(0, g.slots), ssm_cache.index_select(0, g.slots)
                if g.fresh is not None:
                    keep = (~g.fresh).to(conv.dtype)
                    conv, ssm = conv * keep[:, None, None], ssm * keep[:, None, None, None]

            def store(new_conv: torch.Tensor, new_ssm: torch.Tensor, slots: torch.Tensor = g.slots) -> None:
                conv_cache.index_copy_(0, slots, new_conv.to(conv_cache.dtype))
                ssm_cache.index_copy_(0, slots, new_ssm.to(ssm_cache.dtype))

            out.append(RecurrentState(conv, ssm, None, store, g.index))
        return out
