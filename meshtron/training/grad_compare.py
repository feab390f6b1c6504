"""Comparing the captured gradients of two runs (training/grad_capture.py): the relative difference
of every tensor against the bound its precision and depth lead one to expect.

Rounding errors grow as the gradient flows back from the loss. Number the layers l = 0 (embedding),
1..L (the sublayers of the pattern), L + 1 (output head, MTP depths, distillation projections): the
gradient of layer l has passed through L + 1 - l layers, each of which amplifies the error it
receives by about a factor C and adds its own, so the relative difference of two runs that differ
only in reduction order (another layout) or rounding is expected below

    bound(l) = k * C^(L + 1 - l) * eps,       relative difference = ||a - b|| / max(||a||, ||b||)

with eps the machine epsilon of the precision (fp32 1.2e-7, bf16 7.8e-3). The defaults k and C
are set from measured fp32 layout comparisons with a wide margin (docs/training.md), and a changed
seed or learning rate is far above them.

    meshtron grads compare RUN_A_DIR RUN_B_DIR [--step N] [--k K] [--c C] [--precision P]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from meshtron.training.grad_capture import captured_steps, load_grads, read_meta

DEFAULT_K = 64.0
DEFAULT_C = 1.1
EPS = {name: torch.finfo(dtype).eps for name, dtype in
       (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = max(float(a.norm()), float(b.norm()))
    return float((a - b).norm()) / scale if scale > 0 else 0.0


def layer_index(name: str, num_layers: int) -> int:
    """0 for the embedding, 1..L for sublayer i - 1 of the pattern, L + 1 for everything after."""
    m = _LAYER.search(name)
    if m:
        return int(m.group(1)) + 1
    if name.startswith(("embedding.", "position_embedding.")):
        return 0
    return num_layers + 1


def expected_bound(layer: int, num_layers: int, precision: str = "fp32", k: float = DEFAULT_K,
                   c: float = DEFAULT_C) -> float:
    if precision not in EPS:
        raise ValueError(f"--precision: {precision!r} is not allowed; choose one of: {', '.join(EPS)}")
    return k * c ** (num_layers + 1 - layer) * EPS[precision]


@dataclass
class GradDiff:
    name: str
    layer: int
    rel_diff: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.rel_diff <= self.bound


def compare_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], num_layers: int,
                  precision: str = "fp32", k: float = DEFAULT_K, c: float = DEFAULT_C) -> list[GradDiff]:
    """One GradDiff per tensor both captures hold (same shapes required), in name order."""
    out = []
    for name in sorted(set(a) & set(b)):
        if a[name].shape != b[name].shape:
            raise ValueError(f"{name}: shapes {list(a[name].shape)} and {list(b[name].shape)} differ; "
                             "compare runs of the same model and global batch")
        layer = layer_index(name, num_layers)
        out.append(GradDiff(name, layer, relative_difference(a[name], b[name]),
                            expected_bound(layer, num_layers, precision, k, c)))
    return out


def compare_runs(dir_a: str | Path, dir_b: str | Path, step: Optional[int] = None, precision: Optional[str] = None,
                 k: float = DEFAULT_K, c: float = DEFAULT_C) -> list[GradDiff]:
    """Compare the captures of one step (default: the last step both hold) of two runs."""
    meta_a, meta_b = read_meta(dir_a), read_meta(dir_b)
    if meta_a["num_layers"] != meta_b["num_layers"]:
        raise ValueError(f"the runs have {meta_a['num_layers']} and {meta_b['num_layers']} sublayers; "
                         "compare runs of the same model")
    if step is None:
        common = sorted(set(captured_steps(dir_a)) & set(captured_steps(dir_b)))
        if not common:
            raise ValueError(f"{dir_a} and {dir_b} captured no step in common")
        step = common[-1]
    # the coarser precision of the two sets the expected error
    precision = precision or max(meta_a["precision"], meta_b["precision"], key=lambda p: EPS.get(p, 0.0))
    return compare_grads(load_grads(dir_a, step), load_grads(dir_b, step), meta_a["num_layers"], precision, k, c)


def format_table(diffs: list[GradDiff]) -> str:
    width = max([len(d.name) for d in diffs] + [4])
    lines = [f"{'name':<{width}}  {'layer':>5}  {'rel diff':>10}  {'bound':>10}  ok"]
    for d in diffs:
        lines.append(f"{d.name:<{width}}  {d.layer:>5}  {d.rel_diff:>10.3e}  {d.bound:>10.3e}  "
                     f"{'yes' if d.ok else 'NO'}")
    worst = max(diffs, key=lambda d: d.rel_diff / d.bound, default=None)
    if worst is not None:
        lines.append(f"{sum(d.ok for d in diffs)}/{len(diffs)} within the bound; worst ratio "
                     f"{worst.rel_diff / worst.bound:.3g} ({worst.name})")
    return "\n".join(lines)


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        diffs = compare_runs(args.run_a, args.run_b, args.step, args.precision, args.k, args.c)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(diffs))
    return 0 if all(d.ok for d in diffs) and not any(math.isnan(d.rel_diff) for d in diffs) else 1


def register(sub) -> None:
    grads = sub.add_parser("grads", help="compare gradients captured with --save-wgrads / --save-dgrads")
    grads_sub = grads.add_subparsers(dest="grads_command", required=True, parser_class=type(grads))
    cmp = grads_sub.add_parser("compare", help="relative difference per tensor against the expected bound "
                               "k * C^(L+1-l) * eps; exit status 1 if any tensor exceeds it")
    cmp.add_argument("run_a", help="capture directory of the first run")
    cmp.add_argument("run_b", help="capture directory of the second run")
    cmp.add_argument("--step", type=int, default=None, help="captured step (default: the last one both hold)")
    cmp.add_argument("--precision", default=None, choices=sorted(EPS), help="default: the coarser of the two runs")
    cmp.add_argument("--k", type=float, default=DEFAULT_K, help=f"bound factor k (default {DEFAULT_K:g})")
    cmp.add_argument("--c", type=float, default=DEFAULT_C, help=f"per-layer growth C (default {DEFAULT_C:g})")
    cmp.set_defaults(func=cmd_compare)
