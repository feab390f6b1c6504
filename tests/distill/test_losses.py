"""Each distillation loss against its closed form, computed with numpy loops on small tensors; the
gradient of the forward KL against T (q - p); the balancer's weighted sum and logged terms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshtron.config import ConfigError, DistillConfig
from meshtron.distill import HiddenCosine, HiddenMSE, LogitsKL, LossBalancer, ModelOutputs, TopKLogitsKL, build_losses


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.fixture
def case():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 3, 7, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(2, 3, 7, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]], dtype=torch.float64)
    return student, teacher, mask


def reference(student, teacher, mask, per_token):
    total = 0.0
    for b in range(mask.shape[0]):
        for s in range(mask.shape[1]):
            if mask[b, s]:
                total += per_token(student[b, s].numpy(), teacher[b, s].numpy())
    return total


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("reverse", [False, True])
def test_logits_kl_closed_form(case, temperature, reverse):
    student, teacher, mask = case

    def kl(zs, zt):
        q, p = softmax(zs / temperature), softmax(zt / temperature)
        a, b = (q, p) if reverse else (p, q)
        return temperature ** 2 * sum(a[v] * (np.log(a[v]) - np.log(b[v])) for v in range(len(a)))

    loss, n, report = LogitsKL(temperature, reverse)(ModelOutputs(student), ModelOutputs(teacher), mask)
    assert float(n) == 4 and report == {}
    assert float(loss) == pytest.approx(reference(student, teacher, mask, kl), rel=1e-10)


def test_forward_kl_gradient_is_t_times_q_minus_p(case):
    student, teacher, mask = case
    t = 2.0
    z = student.clone().requires_grad_(True)
    LogitsKL(t)(ModelOutputs(z), ModelOutputs(teacher), mask)[0].backward()
    expected = t * (torch.softmax(student / t, -1) - torch.softmax(teacher / t, -1)) * mask[..., None]
    torch.testing.assert_close(z.grad, expected)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_topk_kl_closed_form(case, k):
    student, teacher, mask = case
    t = 1.5

    def topk_kl(zs, zt):
        idx = np.argsort(-zt)[:k]
        p, q = softmax(zt[idx] / t), softmax(zs[idx] / t)
        return t * t * sum(p[i] * (np.log(p[i]) - np.log(q[i])) for i in range(k))

    def mass(zs, zt):
        return softmax(zt / t)[np.argsort(-zt)[:k]].sum()

    loss, n, report = TopKLogitsKL(k, t)(ModelOutputs(student), ModelOutputs(teacher), mask)
    assert float(loss) == pytest.approx(reference(student, teacher, mask, topk_kl), rel=1e-10, abs=1e-12)
    assert float(report["teacher_mass"]) == pytest.approx(reference(student, teacher, mask, mass), rel=1e-6)
    if k == 7:  # the whole vocabulary: the plain forward KL
        full = LogitsKL(t)(ModelOutputs(student), ModelOutputs(teacher), mask)[0]
        assert float(loss) == pytest.approx(float(full), rel=1e-6)


def hidden_case():
    g = torch.Generator().manual_seed(1)
    hs = [torch.randn(2, 3, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    ht = [torch.randn(2, 3, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    logits = torch.zeros(2, 3, 5, dtype=torch.float64)
    return ModelOutputs(logits, hs), ModelOutputs(logits, ht), mask


@pytest.mark.parametrize("loss_cls,per_vector", [
    (HiddenCosine, lambda a, b: 1 - a @ b / np.sqrt((a @ a) * (b @ b))),
    (HiddenMSE, lambda a, b: ((a - b) ** 2).mean()),
])
def test_hidden_losses_closed_form(loss_cls, per_vector):
    student, teacher, mask = hidden_case()
    loss, n, report = loss_cls()(student, teacher, mask)
    pairs = []
    for j in range(2):
        pairs.append(sum(per_vector(student.hidden[j][b, s].numpy(), teacher.hidden[j][b, s].numpy())
                         for b in range(2) for s in range(3) if mask[b, s]))
    assert float(n) == 5
    assert float(loss) == pytest.approx((pairs[0] + pairs[1]) / 2, rel=1e-10)
    assert [float(report[f"pair{j}"]) for j in range(2)] == pytest.approx(pairs, rel=1e-10)


def test_balancer_weights_and_logs_every_term(case):
    student, teacher, mask = case
    cfg = DistillConfig(losses=["kl", "topk_kl"], weights=[0.5, 2.0], label_weight=0.25, top_k=3)
    balancer = LossBalancer(build_losses(cfg), cfg.loss_weights(), cfg.label_weight)
    label = (torch.tensor(3.0, dtype=torch.float64), torch.tensor(4.0), {})
    total, n, extras = balancer(ModelOutputs(student), ModelOutputs(teacher), mask, label)
    kl = LogitsKL()(ModelOutputs(student), ModelOutputs(teacher), mask)[0]
    topk = TopKLogitsKL(3)(ModelOutputs(student), ModelOutputs(teacher), mask)[0]
    assert float(total) == pytest.approx(0.25 * 3.0 + 0.5 * float(kl) + 2.0 * float(topk), rel=1e-6)
    assert float(n) == 4
    assert set(extras) == {"lm_loss", "distill_kl", "distill_topk_kl", "distill_topk_kl_teacher_mass"}
    assert float(extras["distill_kl"][0]) == pytest.approx(float(kl))


def test_unknown_or_repeated_loss_names_are_refused():
    with pytest.raises(ConfigError, match="distill.losses: 'kld' is not allowed"):
        build_losses(DistillConfig(losses=["kld"]))
    with pytest.raises(ConfigError, match="names a loss twice"):
        build_losses(DistillConfig(losses=["kl", "kl"]))
