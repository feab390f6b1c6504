"""Curves of a run as PNG (matplotlib, the optional extra 'plot') and CSV: one plotting helper for
the training loss curve (train and valid loss per step, read from metrics.jsonl) and the GRPO
reward curve (meshtron/rl/plot.py)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class Line:
    """One plotted series: (x, y) points, its legend label, and matplotlib style (fmt, keywords)."""

    points: list[tuple[float, float]]
    label: str
    fmt: str = "-"
    style: dict[str, Any] = field(default_factory=dict)


def plot_lines(png_path: str | Path, lines: list[Line], xlabel: str, title: str, ylabel: str = "",
               ylim: Optional[tuple[float, float]] = None, legend_loc: str = "best") -> Optional[Path]:
    """Write the PNG of `lines` (empty ones are skipped); None when matplotlib is not installed
    (pip install 'meshtron[plot]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for line in lines:
        if line.points:
            ax.plot(*zip(*line.points), line.fmt, label=line.label, **line.style)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if any(line.points for line in lines):
        ax.legend(loc=legend_loc, fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return Path(png_path)


def loss_points(metrics_path: str | Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """-> ([(step, train loss)], [(step, valid loss)]) from a metrics.jsonl, sorted by step. A step
    logged twice (a resumed run re-took the steps after its checkpoint) keeps its last record."""
    train: dict[int, float] = {}
    valid: dict[int, float] = {}
    with open(metrics_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a killed process
                continue
            loss = record.get("loss")
            if not isinstance(loss, (int, float)):
                continue
            if record.get("kind") == "train":
                train[int(record["step"])] = float(loss)
            elif record.get("kind") == "valid":
                valid[int(record["step"])] = float(loss)
    return sorted(train.items()), sorted(valid.items())


def write_loss_curve(run_dir: str | Path, title: str = "training loss") -> tuple[Path, Optional[Path]]:
    """Write <run_dir>/loss_curve.csv (step, train_loss, valid_loss; a blank where a step has none) and,
    with matplotlib, loss_curve.png. -> (csv path, png path or None)."""
    run_dir = Path(run_dir)
    train, valid = loss_points(run_dir / "metrics.jsonl")
    csv_path = run_dir / "loss_curve.csv"
    by_step: dict[int, list[Any]] = {}
    for step, loss in train:
        by_step.setdefault(step, ["", ""])[0] = loss
    for step, loss in valid:
        by_step.setdefault(step, ["", ""])[1] = loss
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "train_loss", "valid_loss"])
        for step in sorted(by_step):
            writer.writerow([step, *by_step[step]])
    png = plot_lines(run_dir / "loss_curve.png", [Line(train, "train loss", style={"lw": 1.5}),
                                                  Line(valid, "valid loss", "o-", {"lw": 2})],
                     xlabel="step", ylabel="loss", title=title, legend_loc="upper right")
    return csv_path, png
