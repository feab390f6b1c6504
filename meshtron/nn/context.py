"""Context objects: where each token sits, and where attention finds its keys and values.

Mixers take `forward(x, ctx)`. Training passes a `PackedContext` (causal, optionally with packed
document boundaries); the simple generator passes a `KVCacheContext` that appends keys/values to a
contiguous per-layer cache. Attention asks the context for keys/values and the mask; it never owns
a cache. The inference engine adds a paged context with the same methods.

The mask contract: `attention_mask(window_size)` is a boolean (batch or 1, 1, queries, keys) tensor,
True where a query may attend a key: causal, same document when packed, and with a window W a query
at index i sees keys j with i - W < j <= i (itself and the W-1 before it). `sdpa_mask(window_size)`
gives the same as keyword arguments for `scaled_dot_product_attention` (just `is_causal` when it can).
A full-sequence context also offers `flex_block_mask(window_size)`: the same mask as a FlexAttention
`BlockMask` (nn/flex_attention.py), built once per forward and shared by every layer.

The recurrent-state contract (Mamba): `mamba_states(layer_id)` returns None (every row starts from
a zero state and nothing is kept: training) or a list of `RecurrentState`s, each covering some
sequences of the batch: which tokens are theirs (or the whole batch), each one's starting conv and
SSM state, how many of its tokens are real (right padding after them), and where the states after
its last real token go.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from meshtron.nn.flex_attention import build_block_mask


@dataclass
class RecurrentState:
    """One Mamba layer's state for some sequences of a forward, one row each.

    conv: (rows, conv_kernel - 1, channels) inputs before each row's first token, or None (zeros).
    ssm: (rows, heads, head_dim, state_dim), or None (zeros).
    lengths: (rows,) long, real tokens per row (the rest is right padding), or None (all real).
    store(conv, ssm): receives the states after each row's last real token.
    index: (rows, q) long, where each row's tokens sit in the forward's flattened (batch * seq) tokens
    (a packed batch holds several sequences in one row), or None: the rows are the batch's own.
    """

    conv: Optional[torch.Tensor]
    ssm: Optional[torch.Tensor]
    lengths: Optional[torch.Tensor]
    store: Callable[[torch.Tensor, torch.Tensor], None]
    index: Optional[torch.Tensor] = None


@runtime_checkable
class MixerContext(Protocol):
    """What every mixer may ask of the `ctx` it is given (the contracts in the module docstring).
    Implemented by PackedContext and KVCacheContext here, parallel/context_parallel.CPContext and the
    engine's inference/paged_context.PagedContext and inference/varlen_context.VarlenPagedContext.
    Attention also needs the masks (`MaskingContext`) unless the context computes the product itself
    (`attend(q, k, v, *, scale, window_size, sink_logits, dropout)`: ring attention, the engine's varlen
    layout); Mamba layers need `mamba_states` (`RecurrentContext`). Full-sequence contexts may also offer
    FlexAttention (`flex_block_mask`, `is_plain_causal`)."""

    positions: torch.Tensor  # the tokens' positions, (batch or rows, seq)
    rope: Optional[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) for those positions, filled by the model

    def update_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's keys/values in -> every key/value the queries attend to (cached ones too)."""
        ...


@runtime_checkable
class MaskingContext(MixerContext, Protocol):
    def attention_mask(self, window_size: Optional[int] = None) -> torch.Tensor:
        ...

    def sdpa_mask(self, window_size: Optional[int] = None) -> dict[str, Any]:
        ...


@runtime_checkable
class RecurrentContext(MixerContext, Protocol):
    def mamba_states(self, layer_id: int) -> Optional[list[RecurrentState]]:
        ...


@dataclass
class PackedContext:
    """Training/full-sequence context.

    positions: (batch, seq) long. document_ids: (batch, seq) long or None; when given, a token
    attends only to earlier tokens of the same document.
    """

    positions: torch.Tensor
    document_ids: Optional[torch.Tensor] = None
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (cos, sin), filled by the model
    _masks: dict[Optional[int], torch.Tensor] = field(default_factory=dict, repr=False)  # by window size

    @classmethod
    def for_tokens(cls, tokens: torch.Tensor, document_ids: Optional[torch.Tensor] = None,
                   positions: Optional[torch.Tensor] = None) -> PackedContext:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        return cls(positions=positions, document_ids=document_ids)

    def update_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def mamba_states(self, layer_id: int) -> Optional[list[RecurrentState]]:
        return None  # every row starts from zero; documents are kept apart by document_ids

    def attention_mask(self, window_size: Optional[int] = None) -> torch.Tensor:
        """Boolean (batch or 1, 1, seq, seq): causal, same document if packed, within the window if given."""
        if window_size not in self._masks:
            seq = self.positions.shape[1]
            idx = torch.arange(seq, device=self.positions.device)
            mask = causal_window_mask(idx, idx, window_size)[None, None]
            if self.document_ids is not None:
                same_doc = self.document_ids[:, :, None] == self.document_ids[:, None, :]
                mask = mask & same_doc[:, None]  # (batch, 1, seq, seq)
            self._masks[window_size] = mask
        return self._masks[window_size]

    def sdpa_mask(self, window_size: Optional[int] = None) -> dict[str, Any]:
        """Keyword arguments for `scaled_dot_product_attention`: causal, plus same-document if packed."""
        if self.document_ids is None and window_size is None:
            return {"is_causal": True}
        return {"attn_mask": self.attention_mask(window_size)}

    def is_plain_causal(self, window_size: Optional[int] = None) -> bool:
        """Whether the mask is causal only (no documents, no window): SDPA's is_causal covers it."""
        return self.document_ids is None and window_size is None

    @torch.compiler.disable  # built eagerly, once, even when the layer asking first is compiled
    def flex_block_mask(self, window_size: Optional[int] = None):
        """The `attention_mask(window_size)` as a FlexAttention BlockMask, built on first request."""
        # cached by window size in an attribute that is not a dataclass field: `dataclasses.replace` (FSDP's
        # mixed-precision cast of forward inputs) builds the copy through __init__, which takes fields only
        masks = self.__dict__.setdefault("_block_masks", {})
        if window_size not in masks:
            masks[window_size] = build_block_mask(self.positions, self.document_ids, window_size)
        return masks[window_size]


@dataclass
class KVCacheContext:
    """Decoding context with a contiguous cache per attention layer: (batch, kv_heads, max_len, head_dim).

    All sequences in the batch share the same length (the simple generator's contract).
    Call `advance(n)` after each forward of n new tokens. Mamba layers keep their conv and SSM
    states here too, so a prompt may be fed in several pieces.
    """

    batch_size: int
    max_len: int
    offset: int = 0
    positions: Optional[torch.Tensor] = None
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _num_new: int = 0
    states: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)  # Mamba

    def begin(self, tokens: torch.Tensor) -> KVCacheContext:
        """Prepare positions for a forward over `tokens` (batch, new) appended after `offset`."""
        self._num_new = tokens.shape[1]
        if self.offset + self._num_new > self.max_len:
            raise ValueError(f"sequence of {self.offset + self._num_new} tokens exceeds the cache of {self.max_len}")
        pos = torch.arange(self.offset, self.offset + self._num_new, device=tokens.device)
        self.positions = pos.expand(tokens.shape[0], -1)
        return self

    def update_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (batch, kv_heads, new, head_dim) -> all keys/values so far."""
        if layer_id not in self.cache:
            # keys and values may differ in width (multi-latent attention): each gets its own shape
            self.cache[layer_id] = tuple(t.new_zeros(t.shape[0], t.shape[1], self.max_len, t.shape[3]) for t in (k, v))
        k_cache, v_cache = self.cache[layer_id]
        end = self.offset + k.shape[2]
        k_cache[:, :, self.offset:end] = k
        v_cache[:, :, self.offset:end] = v
        return k_cache[:, :, :end], v_cache[:, :, :end]

    def mamba_states(self, layer_id: int) -> list[RecurrentState]:
        conv, ssm = self.states.get(layer_id, (None, None))

        def store(new_conv: torch.Tensor, new_ssm: torch.Tensor) -> None:
            self.states[layer_id] = (new_conv, new_ssm)

        return [RecurrentState(conv, ssm, None, store)]

    def attention_mask(self, window_size: Optional[int] = None) -> torch.Tensor:
        """Boolean (1, 1, new, offset + new): the new tokens against everything cached so far."""
        device = self.positions.device
        q_idx = torch.arange(self.offset, self.offset + self._num_new, device=device)
        k_idx = torch.arange(self.offset + self._num_new, device=device)
        return causal_window_mask(q_idx, k_idx, window_size)[None, None]

    def sdpa_mask(self, window_size: Optional[int] = None) -> dict[str, Any]:
        if window_size is not None and self.offset + self._num_new > window_size:
            return {"attn_mask": self.attention_mask(window_size)}
        n = self._num_new
        if n == 1:
            return {}
        if self.offset == 0:
            return {"is_causal": True}
        return {"attn_mask": self.attention_mask()}

    def advance(self) -> None:
        self.offset += self._num_new


def causal_window_mask(q_idx: torch.Tensor, k_idx: torch.Tensor, window_size: Optional[int]) -> torch.Tensor:
    """(queries, keys) boolean: key index <= query index, and within `window_size` of it when given."""
    diff = q_idx[:, None] - k_idx[None, :]
    mask = diff >= 0
    if window_size is not None:
        mask = mask & (diff < window_size)
    return mask
