"""A plain sampling loop with a contiguous KV cache: prefill the prompt, then one token at a time.
The batched serving engine replaces this for throughput; this stays as the reference path. Tokens are
drawn by the engine's own sampler (`sampler.sample_rows`), so both paths filter and break ties alike."""

from __future__ import annotations

from typing import Optional

import torch

from meshtron.inference.request import SamplingParams
from meshtron.inference.sampler import sample_rows
from meshtron.nn.context import KVCacheContext


@torch.no_grad()
def generate_tokens(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, *,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                    stop_ids: tuple[int, ...] = (), max_len: Optional[int] = None) -> list[int]:
    """Return the generated ids (not including the prompt). Stops at a stop id or max_new_tokens."""
    model.eval()
    device = next(model.parameters()).device
    limit = max_len or model.cfg.max_position_embeddings
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= limit:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model takes at most {limit - 1}")
    max_new_tokens = min(max_new_tokens, limit - len(prompt_ids))
    params = SamplingParams(max_tokens=max(max_new_tokens, 1), temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed)
    params.validate("generate", len(prompt_ids), limit, model.vocab_size)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    ctx = KVCacheContext(batch_size=1, max_len=len(prompt_ids) + max_new_tokens)
    tokens = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens, ctx.begin(tokens))[:, -1]
        ctx.advance()
        sampled = sample_rows(logits, [params], [generator], ["generate"])["generate"]
        if sampled.error is not None:
            raise ValueError(sampled.error)
        out.append(sampled.token_id)
        if out[-1] in stop_ids:
            break
        tokens = torch.tensor([[sampled.token_id]], device=device)
    return out
