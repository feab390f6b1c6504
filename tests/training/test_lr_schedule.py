"""Learning-rate schedule against closed forms."""

from __future__ import annotations

import math

import pytest

from meshtron.config import SchedulerConfig
from meshtron.training.lr_schedule import LRSchedule


def make(style, **kw):
    cfg = SchedulerConfig(warmup_steps=10, decay_style=style, min_lr=0.1, **kw)
    return LRSchedule(1.0, cfg, train_iters=110)


def test_warmup_is_linear_from_init():
    s = LRSchedule(1.0, SchedulerConfig(warmup_steps=10, warmup_init_lr=0.2), 100)
    assert [round(s(i), 6) for i in (0, 5, 10)] == [0.2, 0.6, 1.0]


@pytest.mark.parametrize("step", [10, 35, 60, 85, 110])
def test_cosine_linear_constant(step):
    p = (step - 10) / 100
    assert make("cosine")(step) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
    assert make("linear")(step) == pytest.approx(0.1 + 0.9 * (1 - p))
    assert make("constant")(step) == 1.0


def test_after_decay_holds_min():
    assert make("cosine")(500) == 0.1 and make("linear")(111) == 0.1


@pytest.mark.parametrize("style,fn", [
    ("linear", lambda q: 1 - q),
    ("cosine", lambda q: 0.5 * (1 + math.cos(math.pi * q))),
    ("minus_sqrt", lambda q: 1 - math.sqrt(q)),
])
def test_wsd_stable_then_decay(style, fn):
    s = make("WSD", wsd_decay_steps=20, wsd_decay_style=style)
    assert s(50) == 1.0 and s(90) == 1.0   # stable phase up to decay_steps - wsd_decay_steps
    for step in (95, 100, 110):
        q = (step - 90) / 20
        assert s(step) == pytest.approx(0.1 + 0.9 * fn(q))


def test_wsd_exponential_is_geometric():
    s = make("WSD", wsd_decay_steps=20, wsd_decay_style="exponential")
    assert s(100) == pytest.approx(math.sqrt(1.0 * 0.1))  # halfway between 1.0 and 0.1 geometrically
    assert s(110) == 0.1
