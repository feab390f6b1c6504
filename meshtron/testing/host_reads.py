"""Counting device-to-host reads on a CPU, where nothing waits at one, so that tests can show where a GPU
would: the Python-level reads (Tensor.item/.tolist/.cpu/.numpy, int()/float()/bool()/index()) and,
through a dispatch mode, the operators whose output size depends on tensor values (nonzero,
masked_select, unique, bincount, boolean indexing, repeat_interleave without output_size).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

import meshtron
from meshtron.compat import dispatch_mode_base

READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
VALUE_SHAPED_OPS = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                    "bincount", "_local_scalar_dense", "argwhere"}
PACKAGE = str(Path(meshtron.__file__).parent) + os.sep
TORCH = str(Path(torch.__file__).parent) + os.sep


def meshtron_site(skip_torch: bool) -> Optional[str]:
    """'file:line' of the meshtron code making the read, or None when the caller is not meshtron's
    (torch's internals read host-resident tensors by design, e.g. the optimizers' step counters);
    `skip_torch` looks through torch's own frames to the meshtron code that called them."""
    for frame in reversed(traceback.extract_stack()[:-2]):  # without this function and the counting frame
        if skip_torch and frame.filename.startswith(TORCH):
            continue
        if frame.filename.startswith(PACKAGE):
            return f"{frame.filename[len(PACKAGE):]}:{frame.lineno}"
        return None
    return None


def _reads_values(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in VALUE_SHAPED_OPS:
        return True
    if name == "repeat_interleave":
        return (kwargs.get("output_size", args[2] if len(args) > 2 else None) is None
                and isinstance(args[0], torch.Tensor) and len(args) > 1 and isinstance(args[1], torch.Tensor))
    return name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


class _ValueShapedOps(dispatch_mode_base()):
    def __init__(self, log: list[str], inside: list[int], only_meshtron: bool):
        super().__init__()
        self.log, self.inside, self.only_meshtron = log, inside, only_meshtron

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside[0] and _reads_values(func, args, kwargs):  # not already counted at the Python level
            site = meshtron_site(skip_torch=True)
            if site or not self.only_meshtron:
                self.log.append(f"{func} at {site or '?'}")
        return func(*args, **kwargs)


@contextmanager
def count_host_reads(only_meshtron: bool = False) -> Iterator[list[str]]:
    """Yields a list collecting one 'what at file:line' entry per host read while active; with
    `only_meshtron`, only the reads meshtron's own code makes (directly or through torch's functions)."""
    log: list[str] = []
    inside = [0]  # a read's own implementation may read again (float -> item): count the outer one
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            if not inside[0]:
                site = meshtron_site(skip_torch=False)
                if site or not only_meshtron:
                    log.append(f"{name} at {site or '?'}")
            inside[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                inside[0] -= 1
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        with _ValueShapedOps(log, inside, only_meshtron):
            yield log
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
