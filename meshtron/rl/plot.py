"""The reward curve as a PNG (matplotlib, the optional extra 'plot'): the mean training reward per
GRPO step and the held-out greedy success rate at each evaluation, read from reward_curve.csv."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional


def read_curve(path: str | Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """-> ([(step, mean reward)], [(step, greedy success)]) from a reward_curve.csv."""
    rewards, success = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["reward_mean"]:
                rewards.append((int(row["step"]), float(row["reward_mean"])))
            if row["greedy_success"]:
                success.append((int(row["step"]), float(row["greedy_success"])))
    return rewards, success


def write_reward_plot(csv_path: str | Path, png_path: str | Path, title: str = "GRPO") -> Optional[Path]:
    """Write the PNG; None when matplotlib is not installed (pip install 'meshtron[plot]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rewards, success = read_curve(csv_path)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if rewards:
        ax.plot(*zip(*rewards), lw=1, alpha=0.5, label="training reward (mean of the step's rollouts)")
        window = 10
        values = [v for _, v in rewards]
        smooth = [(s, sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1]))
                  for i, (s, _) in enumerate(rewards)]
        ax.plot(*zip(*smooth), lw=2, label=f"training reward ({window}-step mean)")
    if success:
        ax.plot(*zip(*success), "o-", lw=2, label="held-out greedy success")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return Path(png_path)
