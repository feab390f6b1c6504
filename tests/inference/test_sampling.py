"""Sampling filters against naive references, and seeded reproducibility of generation. The plain
generator (`simple.generate_tokens`) and the engine share one sampler (`sampler.filter_rows`)."""

from __future__ import annotations

import torch

from meshtron.config import ModelConfig
from meshtron.inference.request import SamplingParams
from meshtron.inference.sampler import filter_rows
from meshtron.inference.simple import generate_tokens
from meshtron.models import GPTModel


def filter_logits(logits, top_k=0, top_p=1.0):
    return filter_rows(logits, [SamplingParams(top_k=top_k, top_p=top_p)] * logits.shape[0])


def sample_next(logits, temperature=1.0, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(filter_logits(logits / temperature).softmax(-1), 1, generator=generator)[:, 0]


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


def test_top_k_keeps_ties_like_transformers():
    # one tie rule for the engine and the plain generator: every token tied with the k-th logit stays,
    # as transformers' TopKLogitsWarper (and vLLM) keep them
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.5], [0.3, -1.0, 0.3, 0.2, 2.0, 0.3]])
    for k in (1, 2, 3, 5):
        reference = torch.isfinite(TopKLogitsWarper(top_k=k)(None, logits.clone()))
        assert torch.equal(torch.isfinite(filter_logits(logits, top_k=k)), reference), k
    # top-k, then top-p over what top-k kept (transformers applies the warpers in this order); without ties,
    # since which of several tied tokens top-p cuts depends on the sort
    logits = torch.tensor([[1.0, 3.0, 2.2, 2.0, 1.7, 0.5], [0.3, -1.0, 0.35, 0.2, 2.0, 0.31]])
    for k, p in ((3, 0.6), (4, 0.9), (2, 0.3), (5, 0.95)):
        reference = TopPLogitsWarper(top_p=p)(None, TopKLogitsWarper(top_k=k)(None, logits.clone()))
        assert torch.equal(torch.isfinite(filter_logits(logits, top_k=k, top_p=p)), torch.isfinite(reference)), (k, p)


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
