"""Learning-rate schedule: linear warmup, then cosine / linear / constant / WSD decay to min_lr.

With W = warmup_steps, D = decay_steps, s = step:
  s < W:            lr = init + (peak - init) * s / W
  W <= s <= D:      progress p = (s - W) / (D - W)
     cosine:        min + (peak - min) * (1 + cos(pi p)) / 2
     linear:        min + (peak - min) * (1 - p)
     constant:      peak
     WSD:           peak until the last `wsd_decay_steps` before D, then decays over them in
                    wsd_decay_style (linear, cosine, exponential, minus_sqrt)
  s > D:            min
"""

from __future__ import annotations

import math

from meshtron.config.schema import SchedulerConfig


class LRSchedule:
    def __init__(self, peak_lr: float, cfg: SchedulerConfig, train_iters: int):
        self.peak, self.cfg = peak_lr, cfg
        self.warmup = cfg.warmup_steps
        self.decay_steps = max(cfg.decay_steps or train_iters, self.warmup)
        span = self.decay_steps - self.warmup
        self.wsd_steps = cfg.wsd_decay_steps if cfg.wsd_decay_steps is not None else max(1, span // 10)

    def __call__(self, step: int) -> float:
        cfg, peak, low = self.cfg, self.peak, self.cfg.min_lr
        if step < self.warmup:
            return cfg.warmup_init_lr + (peak - cfg.warmup_init_lr) * step / self.warmup
        if step > self.decay_steps:
            return low if cfg.decay_style != "constant" else peak
        span = self.decay_steps - self.warmup
        p = (step - self.warmup) / span if span > 0 else 1.0
        if cfg.decay_style == "constant":
            return peak
        if cfg.decay_style == "linear":
            return low + (peak - low) * (1.0 - p)
        if cfg.decay_style == "cosine":
            return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * p))
        return self._wsd(step)

    def _wsd(self, step: int) -> float:
        start = self.decay_steps - self.wsd_steps
        if step <= start:
            return self.peak
        q = min(1.0, (step - start) / self.wsd_steps)
        style, peak, low = self.cfg.wsd_decay_style, self.peak, self.cfg.min_lr
        if style == "linear":
            factor = 1.0 - q
        elif style == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * q))
        elif style == "exponential":
            # geometric interpolation from peak to min (to a tiny floor when min_lr is 0)
            floor = max(low, peak * 1e-3)
            return peak * (floor / peak) ** q if q < 1.0 else low
        else:  # minus_sqrt
            factor = 1.0 - math.sqrt(q)
        return low + (peak - low) * factor

    def state_dict(self) -> dict:
        return {"peak": self.peak, "decay_steps": self.decay_steps}
