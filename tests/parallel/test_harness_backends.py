"""run_ranks' backends (issue 18): by default the ranks see no GPU and run gloo on the CPU on any
machine; MESHTRON_TEST_BACKEND=nccl gives rank r the GPU cuda:r and NCCL, and is skipped in one line
where the machine has fewer GPUs than ranks (here: always)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from meshtron.testing import multiprocess
from meshtron.testing.multiprocess import BACKEND_ENV, rank_backend, rank_device_type, run_ranks


def where_am_i(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=60))
    device = torch.device(rank_device_type(), rank) if rank_device_type() == "cuda" else torch.device("cpu")
    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)
    return {"backend": dist.get_backend(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda": torch.cuda.is_available(), "device": str(total.device), "sum": float(total),
            "current": torch.cuda.current_device() if torch.cuda.is_available() else None}


def test_default_ranks_run_gloo_on_the_cpu(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    for out in run_ranks("tests.parallel.test_harness_backends:where_am_i", 2, timeout_s=60):
        assert out == {"backend": "gloo", "visible": "", "cuda": False, "device": "cpu", "sum": 3.0, "current": None}


def test_nccl_needs_a_gpu_per_rank(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "nccl")
    assert (rank_backend(), rank_device_type()) == ("nccl", "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(pytest.skip.Exception, match=rf"{BACKEND_ENV}=nccl: 2 ranks need 2 GPUs and NCCL; this "
                                                    r"machine has \d GPU"):
        run_ranks("tests.parallel.test_harness_backends:where_am_i", 2, timeout_s=60)


def test_unknown_backend_is_one_line(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="MESHTRON_TEST_BACKEND='mpi' is not a test backend; use gloo"):
        multiprocess.rank_backend()


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
                    reason="needs 2 GPUs and NCCL")
def test_nccl_ranks_get_one_gpu_each(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "nccl")
    for rank, out in enumerate(run_ranks("tests.parallel.test_harness_backends:where_am_i", 2, timeout_s=120)):
        assert (out["backend"], out["device"], out["current"], out["sum"]) == ("nccl", f"cuda:{rank}", rank, 3.0)
