"""FlexAttention for full-sequence attention (training, evaluation, log-probs): causal, same-document and
sliding-window masks as one block-sparse `BlockMask` per forward, attention sinks through the
log-sum-exp, grouped-query heads without repeating keys. On CUDA the kernel and the mask builder run
under torch.compile (that is what makes flex a fused kernel); on a CPU flex runs eagerly.

Sinks. For one head with sink logit s and query row i, flex returns, over the keys j the mask allows,
    out_i = sum_j exp(a_ij) v_j / Z_i,   lse_i = log Z_i,   Z_i = sum_j exp(a_ij),   a_ij = scale * q_i . k_j.
Sink attention (attention_core.py) divides by Z_i + exp(s) instead of Z_i, so
    out_sink_i = out_i * Z_i / (Z_i + exp(s)) = out_i * sigmoid(lse_i - s).
The factor is formed in fp32 from flex's fp32 lse: no (seq, seq) logits exist anywhere. A row with no
allowed key has lse_i = -inf and out_i = 0, so factor 0 and output 0 (finite, as in the eager path).
Backward: flex takes a gradient for lse as well as for out, so q and k receive both terms, and
d out_sink_i / d s = -out_sink_i * (1 - sigmoid(lse_i - s)).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")

# Compiled once per process, on first use. dynamic=False: one kernel per shape (a training run has one
# sequence length, evaluation may add another); the mask's window is a captured tensor, not a constant,
# so windowed and full layers share a kernel.
_compiled_flex = None
_compiled_create_block_mask = None


def use_flex(backend: str, q: torch.Tensor, *, masked: bool, sinks: bool, dropout: float) -> bool:
    """Whether a full-sequence attention runs through flex.

    auto: on CUDA when the mask is more than plain causal (documents, a window) or sinks are on, and there
    is no attention dropout (flex has none); SDPA's own kernels (flash with is_causal) otherwise, and
    always on a CPU. sdpa: never. flex: always; attention dropout is refused.
    """
    if backend == "sdpa":
        return False
    if backend == "flex":
        if dropout > 0:
            raise ValueError("model.attention_backend: flex has no attention dropout; set model.attention_dropout 0 "
                             "or model.attention_backend auto")
        return True
    if backend != "auto":
        raise ValueError(f"model.attention_backend: {backend!r}; choose one of {ATTENTION_BACKENDS}")
    return q.is_cuda and dropout == 0 and (masked or sinks)


def mask_mod_for(document_ids: Optional[torch.Tensor], window_size: Optional[int], seq_len: int,
                 device: torch.device):
    """flex's mask_mod(b, h, q_idx, kv_idx) -> bool: key at or before the query, fewer than
    `window_size` positions back (every key when None), and of the same document when packed."""
    window = torch.tensor(window_size if window_size is not None else seq_len, device=device)

    def causal_window(b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        return (diff >= 0) & (diff < window)

    if document_ids is None:
        return causal_window

    def document_causal_window(b, h, q_idx, kv_idx):
        return causal_window(b, h, q_idx, kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    return document_causal_window


def build_block_mask(positions: torch.Tensor, document_ids: Optional[torch.Tensor],
                     window_size: Optional[int]) -> BlockMask:
    """The BlockMask of a packed forward: positions (batch, seq) gives the shape and device, document_ids
    (batch, seq) or None; one mask per batch row when packed, one shared row otherwise.

    On CUDA the builder is compiled, so it evaluates the mask block by block instead of materialising
    a (batch, seq, seq) boolean; on a CPU it runs eagerly."""
    global _compiled_create_block_mask
    batch, seq = positions.shape
    device = positions.device
    mask_mod = mask_mod_for(document_ids, window_size, seq, device)
    if device.type == "cpu":
        builder = create_block_mask
    else:
        if _compiled_create_block_mask is None:
            _compiled_create_block_mask = torch.compile(create_block_mask)
        builder = _compiled_create_block_mask
    rows = batch if document_ids is not None else None
    return builder(mask_mod, rows, None, seq, seq, device=device)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, *, scale: float,
                sink_logits: Optional[torch.Tensor] = None, compiled: Optional[bool] = None) -> torch.Tensor:
    """q (batch, heads, seq, d), k (batch, kv_heads, seq, d), v (batch, kv_heads, seq, dv) -> (batch, heads, seq, dv).

    sink_logits: (heads,) or None (see the module docstring). compiled: run the torch.compile'd kernel;
    None means on CUDA only (a compiled CPU kernel has neither backward nor lse in PyTorch 2.13)."""
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if sink_logits is not None:
        kwargs["return_aux"] = AuxRequest(lse=True)
    if torch.compiler.is_compiling():  # inside a compiled sublayer: flex is traced into its graph
        result = flex_attention(q, k, v, **kwargs)
    elif q.is_cuda if compiled is None else compiled:
        result = _compiled_kernel()(q, k, v, **kwargs)
    else:
        result = _eager_flex(q, k, v, kwargs)
    if sink_logits is None:
        return result
    out, aux = result
    factor = torch.sigmoid(aux.lse - sink_logits.float().view(1, -1, 1))  # (batch, heads, seq), fp32
    return (out.float() * factor.unsqueeze(-1)).to(out.dtype)


def _compiled_kernel():
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _eager_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict):
    """PyTorch's reference implementation (it builds the scores), chosen on purpose on a CPU."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q, k, v, **kwargs)
    except NotImplementedError as e:  # PyTorch 2.13 has no flex backward on a CPU
        if q.device.type != "cpu":
            raise
        raise ValueError(f"model.attention_backend flex on a CPU: {e}; use model.attention_backend auto or sdpa "
                         "there") from None
