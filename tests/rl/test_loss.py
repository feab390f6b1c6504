"""GRPO losses and advantages against values worked out by hand for small tensors, every variant."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.rl.loss import (
    PolicyLossConfig,
    clip_rewards,
    group_advantages,
    policy_loss,
    token_entropy,
    token_log_probs,
    token_weights,
    zero_variance_fraction,
)


def test_group_advantages_with_and_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 3.0])
    # groups of 2: mean 0.5, sample std sqrt(0.5) -> +-0.5 / 0.70711 = +-0.70711
    a = group_advantages(rewards[:4], 2, scale_by_std=True, eps=0.0)
    assert torch.allclose(a, torch.tensor([0.70711, -0.70711, -0.70711, 0.70711]), atol=1e-5)
    assert torch.allclose(group_advantages(rewards[:4], 2, scale_by_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    # a group of 4: [3, 0, 0, 3] mean 1.5, deviations +-1.5, sample std sqrt(9/3) = 1.73205
    a = group_advantages(rewards[4:], 4, eps=0.0)
    assert torch.allclose(a, torch.tensor([0.86603, -0.86603, -0.86603, 0.86603]), atol=1e-5)
    # three in a group: [3, 0, 0] -> mean 1, deviations [2, -1, -1], std sqrt(6/2) = 1.73205
    a = group_advantages(torch.tensor([3.0, 0.0, 0.0]), 3, eps=0.0)
    assert torch.allclose(a, torch.tensor([1.1547, -0.57735, -0.57735]), atol=1e-4)
    # equal rewards: zero advantage whatever the normalisation (eps keeps it finite)
    assert group_advantages(torch.tensor([1.0, 1.0]), 2).abs().max() == 0
    assert zero_variance_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0]), 2) == pytest.approx(2 / 3)


def test_reward_clipping():
    assert clip_rewards(torch.tensor([-5.0, 0.5, 3.0]), 1.0).tolist() == [-1.0, 0.5, 1.0]
    assert clip_rewards(torch.tensor([-5.0, 3.0]), None).tolist() == [-5.0, 3.0]


def test_token_weights_per_aggregation():
    # two sequences with 2 and 4 completion tokens, max_new_tokens 8
    assert token_weights([2, 4], "token_mean", 8) == pytest.approx([1 / 6, 1 / 6])  # DAPO
    assert token_weights([2, 4], "sequence_mean", 8) == pytest.approx([1 / 4, 1 / 8])  # GRPO
    assert token_weights([2, 4], "fixed_length", 8) == pytest.approx([1 / 16, 1 / 16])  # Dr.GRPO
    # global normalisers given by the caller (other ranks / micro-batches hold the rest)
    assert token_weights([2], "token_mean", 8, total_tokens=10) == pytest.approx([0.1])
    assert token_weights([2], "sequence_mean", 8, total_sequences=5) == pytest.approx([0.1])
    with pytest.raises(ValueError, match="aggregation"):
        token_weights([1], "mean", 8)


def _four_tokens():
    # ratios 1.5, 0.5, 0.5, 1.5 with advantages +1, -1, +1, -1
    old = torch.log(torch.tensor([0.2, 0.4, 0.4, 0.2]))
    new = old + torch.log(torch.tensor([1.5, 0.5, 0.5, 1.5]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    return new, old, adv


def test_clipped_surrogate_symmetric_and_clip_higher():
    new, old, adv = _four_tokens()
    w = torch.full((4,), 0.25)
    # eps 0.2: max(-1.5, -1.2) = -1.2 (clipped high); max(0.5, 0.8) = 0.8 (clipped low);
    #          max(-0.5, -0.8) = -0.5; max(1.5, 1.2) = 1.5  -> mean 0.15
    loss, stats = policy_loss(new, old, adv, w, PolicyLossConfig(0.2, 0.2, is_truncation=None))
    assert loss.item() == pytest.approx(0.15, abs=1e-6)
    assert stats["clipped_high"].item() == 1 and stats["clipped_low"].item() == 1
    assert stats["ratio"].item() == pytest.approx(4.0, abs=1e-6)
    # DAPO clip-higher eps_high 0.28: first token max(-1.5, -1.28) = -1.28 -> mean (−1.28+0.8−0.5+1.5)/4 = 0.13
    loss, _ = policy_loss(new, old, adv, w, PolicyLossConfig(0.2, 0.28, is_truncation=None))
    assert loss.item() == pytest.approx(0.13, abs=1e-6)


def test_kl_k3_entropy_and_truncated_importance_sampling():
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    adv, w = torch.tensor([2.0]), torch.tensor([1.0])
    # ratio 1 (on policy): pg = -2; k3 with delta = log(0.25/0.5): 0.5 + 0.693147 - 1 = 0.193147
    cfg = PolicyLossConfig(kl_beta=0.1, entropy_coef=0.01, is_truncation=None)
    loss, stats = policy_loss(logp, logp, adv, w, cfg, ref_log_probs=ref, entropy=torch.tensor([1.5]))
    assert stats["kl"].item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert loss.item() == pytest.approx(-2 + 0.1 * 0.193147 - 0.01 * 1.5, abs=1e-6)
    # rollout engine gave log(0.5 / 3): IS weight 3, truncated at C = 2 -> pg -4
    rollout = logp - math.log(3.0)
    loss, stats = policy_loss(logp, logp, adv, w, PolicyLossConfig(is_truncation=2.0), rollout_log_probs=rollout)
    assert loss.item() == pytest.approx(-4.0, abs=1e-6)
    assert stats["is_weight_max"].item() == pytest.approx(2.0)
    assert stats["logprob_gap"].item() == pytest.approx(math.log(3.0), abs=1e-6)
    # below C the weight passes unchanged: 0.5 -> pg -1
    loss, _ = policy_loss(logp, logp, adv, w, PolicyLossConfig(is_truncation=2.0), rollout_log_probs=logp + math.log(2))
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)


def test_first_on_policy_step_ratio_and_is_weights_are_one_and_gradient_is_reinforce():
    torch.manual_seed(0)
    logits = torch.randn(6, 5, requires_grad=True)
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    logp = token_log_probs(logits, labels)
    old = logp.detach()
    adv = torch.tensor([1.0, 1.0, -0.5, -0.5, 2.0, 0.0])
    lengths = [2, 2, 2]
    w = torch.tensor([x for x in token_weights(lengths, "sequence_mean", 4) for _ in range(2)])
    loss, stats = policy_loss(logp, old, adv, w, PolicyLossConfig(), rollout_log_probs=old)
    assert stats["ratio"].item() == pytest.approx(6.0) and stats["is_weight"].item() == pytest.approx(6.0)
    assert stats["is_weight_min"].item() == 1.0 and stats["clipped_low"].item() == 0 == stats["clipped_high"].item()
    loss.backward()
    # at ratio 1 the gradient is that of -sum w A log p (REINFORCE with the group baseline)
    ref_logits = logits.detach().clone().requires_grad_(True)
    (-(w * adv * token_log_probs(ref_logits, labels)).sum()).backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-7)


def test_aggregation_end_to_end_sequence_mean_vs_token_mean():
    # per-token losses at ratio 1 are -A: sequence 1 (2 tokens, A=1), sequence 2 (4 tokens, A=-0.5)
    adv = torch.tensor([1.0, 1.0, -0.5, -0.5, -0.5, -0.5])
    logp = torch.zeros(6)
    for aggregation, expected in (("sequence_mean", 0.5 * (-1.0 + 0.5)), ("token_mean", (-2 + 2) / 6),
                                  ("fixed_length", (-2 + 2) / (8 * 2))):
        ws = token_weights([2, 4], aggregation, 8)
        w = torch.tensor([ws[0]] * 2 + [ws[1]] * 4)
        loss, _ = policy_loss(logp, logp, adv, w, PolicyLossConfig(is_truncation=None))
        assert loss.item() == pytest.approx(expected, abs=1e-7), aggregation


def test_log_probs_and_entropy_with_temperature():
    logits = torch.tensor([[2.0, 0.0, 0.0]])
    p = torch.tensor([math.e ** 1, 1, 1]) / (math.e + 2)  # temperature 2 halves the logits
    assert token_log_probs(logits, torch.tensor([0]), 2.0).item() == pytest.approx(math.log(p[0]), abs=1e-6)
    assert token_entropy(logits, 2.0).item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)
