"""Sampling filters against naive references, and seeded reproducibility of generation."""

from __future__ import annotations

import torch

from meshtron.config import ModelConfig
from meshtron.inference.sampling import filter_logits, sample_next
from meshtron.inference.simple import generate_tokens
from meshtron.models import GPTModel


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5]])
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.05, 0.3, 0.15])
    logits = probs.log()[None]
    # sorted: 0.5, 0.3, 0.15, 0.05 -> cumulative 0.5, 0.8, 0.95: p=0.75 keeps {0.5, 0.3}; p=0.85 adds 0.15
    assert torch.isfinite(filter_logits(logits, top_p=0.75)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.85)).tolist() == [[True, False, True, True]]


def test_greedy_and_sampling_distribution():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert sample_next(logits, temperature=0).item() == 1
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, 1.0, generator=gen) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=3).float() / 4000
    torch.testing.assert_close(freq, logits.softmax(-1)[0], atol=0.03, rtol=0)


def test_generation_is_seeded_and_greedy_matches_argmax_loop():
    torch.manual_seed(0)
    model = GPTModel(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, max_position_embeddings=32,
                                 make_vocab_size_divisible_by=1), 11)
    a = generate_tokens(model, [1, 2, 3], 8, temperature=1.0, seed=7)
    b = generate_tokens(model, [1, 2, 3], 8, temperature=1.0, seed=7)
    assert a == b
    greedy = generate_tokens(model, [1, 2, 3], 6, temperature=0)
    ids = [1, 2, 3]
    for _ in range(6):  # full recompute, no cache
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert greedy == ids[3:]
