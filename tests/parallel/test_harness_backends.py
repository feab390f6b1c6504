"""run_ranks' backends (issue 18): by default the ranks see no GPU and run gloo on the CPU on any
machine; MESHTRON_TEST_BACKEND=nccl gives rank r the GPU cuda:r and NCCL, and is skipped in one line
where the machine has fewer GPUs than ranks (here: always). No test under tests/ pins its ranks to
gloo or a CPU mesh outside this harness (a static check), so the whole multi-rank suite follows it."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

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


# ---- no test hard-codes gloo or a CPU mesh: the whole multi-rank suite follows MESHTRON_TEST_BACKEND ----

TESTS = Path(__file__).resolve().parents[1]
# what pins a process group or mesh to gloo/the CPU instead of asking rank_backend()/rank_device_type()
HARD_CODED = re.compile(
    r"""init_process_group\(\s*(backend\s*=\s*)?["']gloo["']"""
    r"""|new_group\([^)]*backend\s*=\s*["']gloo["']"""
    r"""|(init_device_mesh|DeviceMesh)\(\s*(device_type\s*=\s*)?["']cpu["']"""
    r"""|backend_options\(\s*["']cpu["']"""
    r"""|device_type\s*=\s*["']cpu["']""")
# in files that start ranks (run_ranks, torchrun): a trainer pinned to the CPU
PINNED_TRAINER = re.compile(r"""["']train\.device["']\s*:\s*["']cpu["']|--train\.device["']\s*,\s*["']cpu["']""")
STARTS_RANKS = ("run_ranks(", "torch.distributed.run")
# a line (or the line above it) may keep gloo with `# test-backend: <why>`: a group that is gloo by design
# whatever the default backend (e.g. `meshtron serve`'s CPU object group)
MARKER = re.compile(r"#\s*test-backend:\s*(\S.*)")
# files that are deliberately CPU/gloo-only, each with its reason
ALLOWLIST = {
    "models/megatron/megatron_harness.py": "a one-rank gloo group that megatron-core's parallel_state needs to "
                                           "build single-device reference layers on the CPU; no ranks are started",
}


def hard_coded_backends(root: Path) -> list[str]:
    """'path:line: text' of every line under `root` that pins a test's ranks to gloo or the CPU."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in ALLOWLIST or path.resolve() == Path(__file__).resolve():
            continue
        lines = path.read_text().splitlines()
        starts_ranks = any(s in line for line in lines for s in STARTS_RANKS)
        for i, line in enumerate(lines):
            code = line.split("#", 1)[0]
            if not (HARD_CODED.search(code) or (starts_ranks and PINNED_TRAINER.search(code))):
                continue
            if MARKER.search(line) or (i and MARKER.search(lines[i - 1])):
                continue
            found.append(f"tests/{rel}:{i + 1}: {line.strip()}")
    return found


def test_no_test_hard_codes_gloo_or_a_cpu_mesh():
    """Every multi-rank test asks rank_backend()/rank_device_type(), so MESHTRON_TEST_BACKEND=nccl runs the
    whole suite on GPUs; a deliberate exception carries `# test-backend: <why>` or an ALLOWLIST reason."""
    found = hard_coded_backends(TESTS)
    assert not found, ("these lines pin ranks to gloo or the CPU; use rank_backend()/rank_device_type()/"
                       "rank_device() from meshtron.testing.multiprocess:\n" + "\n".join(found))
    assert all(reason.strip() for reason in ALLOWLIST.values())
    for path in TESTS.rglob("*.py"):
        for line in path.read_text().splitlines():
            marker = MARKER.search(line)
            assert marker is None or len(marker.group(1).strip()) > 10, f"{path}: a test-backend marker needs a reason"


def test_the_backend_check_sees_each_form(tmp_path):
    """The check itself catches every way of pinning a backend it claims to (and not the asked-for ones)."""
    pinned = ['dist.init_process_group("gloo", timeout=t)', "dist.init_process_group(backend='gloo')",
              'dist.new_group(ranks=[0, 1], backend="gloo", timeout=t)', 'init_device_mesh("cpu", (2,))',
              'DeviceMesh(device_type="cpu", mesh=[0, 1])', 'backend_options("cpu", 60)',
              'init_device_mesh(device_type="cpu", mesh_shape=(2,))']
    asked = ["dist.init_process_group(rank_backend(), timeout=t)", "init_device_mesh(rank_device_type(), (2,))",
             "backend_options(rank_device_type(), 60)", "# a comment about gloo and init_device_mesh('cpu')",
             '# test-backend: the leader objects travel on the CPU by design\ndist.new_group(backend="gloo")']
    (tmp_path / "test_pinned.py").write_text("\n".join(pinned) + '\nrun_ranks(f, 2, overrides={"train.device": "cpu"})\n')
    (tmp_path / "test_asked.py").write_text("\n".join(asked) + '\nTrainer({"train.device": "cpu"})\n')
    found = hard_coded_backends(tmp_path)
    assert [f.split(":")[1] for f in found] == [str(i) for i in range(1, len(pinned) + 2)], found
    assert all(f.startswith("tests/test_pinned.py:") for f in found)
