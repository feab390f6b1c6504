"""Context objects: where each token sits, and where attention finds its keys and values.

Mixers take `forward(x, ctx)`. Training passes a `PackedContext` (causal, optionally with packed
document boundaries); the simple generator passes a `KVCacheContext` that appends keys/values to a
contiguous per-layer cache. Attention asks the context for keys/values and the mask; it never owns
a cache. The inference engine adds a paged context with the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class PackedContext:
    """Training/full-sequence context.

    positions: (batch, seq) long. document_ids: (batch, seq) long or None; when given, a token
    attends only to earlier tokens of the same document.
    """

    positions: torch.Tensor
    document_ids: Optional[torch.Tensor] = None
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (cos, sin), filled by the model
    _mask: Optional[torch.Tensor] = field(default=None, repr=False)

    @classmethod
    def for_tokens(cls, tokens: torch.Tensor, document_ids: Optional[torch.Tensor] = None,
                   positions: Optional[torch.Tensor] = None) -> PackedContext:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        return cls(positions=positions, document_ids=document_ids)

    def update_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def sdpa_mask(self) -> dict[str, Any]:
        """Keyword arguments for `scaled_dot_product_attention`: causal, plus same-document if packed."""
        if self.document_ids is None:
            return {"is_causal": True}
        if self._mask is None:
            seq = self.document_ids.shape[1]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=self.document_ids.device).tril()
            same_doc = self.document_ids[:, :, None] == self.document_ids[:, None, :]
            self._mask = (causal & same_doc)[:, None]  # (batch, 1, seq, seq)
        return {"attn_mask": self._mask}


@dataclass
class KVCacheContext:
    """Decoding context with a contiguous cache per attention layer: (batch, kv_heads, max_len, head_dim).

    All sequences in the batch share the same length (the simple generator's contract).
    Call `advance(n)` after each forward of n new tokens.
    """

    batch_size: int
    max_len: int
    offset: int = 0
    positions: Optional[torch.Tensor] = None
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _num_new: int = 0

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
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.cache[layer_id] = (k.new_zeros(shape), v.new_zeros(shape))
        k_cache, v_cache = self.cache[layer_id]
        end = self.offset + k.shape[2]
        k_cache[:, :, self.offset:end] = k
        v_cache[:, :, self.offset:end] = v
        return k_cache[:, :, :end], v_cache[:, :, :end]

    def sdpa_mask(self) -> dict[str, Any]:
        n = self._num_new
        if n == 1:
            return {}
        if self.offset == 0:
            return {"is_causal": True}
        q_pos = torch.arange(self.offset, self.offset + n)[:, None]
        k_pos = torch.arange(self.offset + n)[None, :]
        return {"attn_mask": (k_pos <= q_pos).to(self.positions.device)}

    def advance(self) -> None:
        self.offset += self._num_new
