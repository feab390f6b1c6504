"""The reward curve as a PNG (matplotlib, the optional extra 'plot'): the mean training reward per
GRPO step and the held-out greedy success rate at each evaluation, read from reward_curve.csv."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

from meshtron.training.plot import Line, plot_lines


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
    rewards, success = read_curve(csv_path)
    window = 10
    values = [v for _, v in rewards]
    smooth = [(s, sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1]))
              for i, (s, _) in enumerate(rewards)]
    lines = [Line(rewards, "training reward (mean of the step's rollouts)", style={"lw": 1, "alpha": 0.5}),
             Line(smooth, f"training reward ({window}-step mean)", style={"lw": 2}),
             Line(success, "held-out greedy success", "o-", {"lw": 2})]
    return plot_lines(png_path, lines, xlabel="GRPO step", title=title, ylim=(0, 1), legend_loc="lower right")
