"""Metric sinks: a JSONL file (always), the console (or a progress bar on a terminal), and
TensorBoard / Weights & Biases as optional extras imported only when enabled."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from meshtron.config.schema import TRACKERS, LoggerConfig, require_tracker


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key} {value:.3e}"
        if math.isfinite(value) and 0 < abs(value) < 1e-3:
            return f"{key} {value:.3e}"
        if abs(value) >= 100:
            return f"{key} {value:.1f}"
        return f"{key} {value:.4f}"
    return f"{key} {value}"


def format_duration(seconds: float) -> str:
    """12s, 3m05s, 2h07m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class MetricsLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, total_steps: int, config_dict: Optional[dict] = None,
                 initial_step: int = 0, enabled: bool = True):
        """`enabled=False` (ranks other than 0) makes every method a no-op."""
        self.enabled = enabled
        self._bar = self._tb = self._wandb = self._jsonl = None
        self.total_steps, self.initial_step = total_steps, initial_step
        self.started = time.perf_counter()
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        use_bar = cfg.progress_bar == "on" or (cfg.progress_bar == "auto" and sys.stderr.isatty())
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True)
        # LoggerConfig.validate already checked these imports; require_tracker repeats it for configs built by hand
        if cfg.tensorboard:
            self._tb = require_tracker("tensorboard", TRACKERS["tensorboard"]).SummaryWriter(
                str(self.run_dir / "tensorboard"))
        if cfg.wandb:
            wandb = require_tracker("wandb", TRACKERS["wandb"])
            mode = cfg.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
            self._wandb = wandb.init(project=cfg.wandb_project, dir=str(self.run_dir), config=config_dict or {},
                                     mode=mode)

    def message(self, text: str) -> None:
        """A human-readable line that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train", echo: bool = True) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": time.time(), **metrics}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(f"{kind}/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in numeric.items()}, step=step)
        if echo:
            fields = [_fmt(k, v) for k, v in metrics.items()]
            where = f"step {step}"
            if kind == "train":
                where = f"step {step}/{self.total_steps}"
                fields += self._progress(step)
            self.message(f"[{kind}] {where} | " + " | ".join(fields))

    def _progress(self, step: int) -> list[str]:
        """Elapsed time since the logger started and the time left at the rate of the steps taken since."""
        elapsed = time.perf_counter() - self.started
        done = step - self.initial_step
        out = [f"elapsed {format_duration(elapsed)}"]
        if done > 0 and step < self.total_steps:
            out.append(f"eta {format_duration(elapsed / done * (self.total_steps - step))}")
        return out

    def advance(self, n: int = 1, loss: Optional[float] = None) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._jsonl is not None:
            self._jsonl.close()
