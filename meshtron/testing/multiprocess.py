"""Run a function on N ranks (gloo on the CPU, or NCCL with one GPU per rank), fast and without the
fork-after-OpenMP deadlock.

`run_ranks("pkg.module:function", world_size, **kwargs)` starts one fresh launcher interpreter
(`python -m meshtron.testing.multiprocess`), which imports torch and the target module but runs no
torch op, then forks the ranks (fork is ~30x faster than spawn; forking is safe because the
launcher never initialised OpenMP). Each rank sets one intra-op thread, gets the torchrun-style
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), calls
`function(rank, world_size, **kwargs)`, and writes its return value with `torch.save`.
The caller gets the list of per-rank results, or a RankFailure naming the ranks that failed with
their tracebacks. Every rank is killed when `timeout_s` passes.

A rank killed by a native crash (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL: a fault inside torch, gloo
or glibc, not a Python error, a hang or a wrong number) gets the whole run repeated once, with a
warning that carries the crash's output (every thread's Python stack, from faulthandler); a second
crash fails. CI saw one such crash (glibc heap-corruption abort in gloo-backed TP training) that 80
reruns could not reproduce.

Backends: by default the ranks see no GPU (CUDA_VISIBLE_DEVICES is emptied), so every test runs gloo
on the CPU on any machine, as CI does. MESHTRON_TEST_BACKEND=nccl runs the same tests on a machine
with at least as many GPUs as ranks: rank r gets cuda:r (LOCAL_RANK=r), the trainer's `auto` device
picks CUDA and NCCL, and tests that start their own groups or meshes ask `rank_backend()` /
`rank_device_type()` and put their tensors on `rank_device()`. With fewer GPUs, run_ranks skips the
test under pytest (else raises BackendUnavailable), in one line; tests that start ranks another way
(torchrun) call `backend_env(world_size)` for the same check and environment.
tests/parallel/test_harness_backends.py fails when a test under tests/ hard-codes gloo or a CPU mesh.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any


class RankFailure(RuntimeError):
    """One or more ranks failed or timed out; the message holds their errors."""


class RankError(str):
    """What a failed rank left instead of a result (its traceback, or why there is none)."""


class BackendUnavailable(RuntimeError):
    """MESHTRON_TEST_BACKEND asks for a backend this machine cannot run with that many ranks."""


BACKEND_ENV = "MESHTRON_TEST_BACKEND"


def rank_backend() -> str:
    """The backend of the ranks' process groups: "gloo" (the default) or "nccl" (MESHTRON_TEST_BACKEND)."""
    name = os.environ.get(BACKEND_ENV, "").strip().lower() or "gloo"
    if name not in ("gloo", "nccl"):
        raise ValueError(f"{BACKEND_ENV}={name!r} is not a test backend; use gloo (the default) or nccl")
    return name


def rank_device_type() -> str:
    """The device type of the ranks' tensors and meshes: "cpu" under gloo, "cuda" under nccl."""
    return "cuda" if rank_backend() == "nccl" else "cpu"


def rank_device():
    """The device of this rank's tensors: the CPU under gloo, its own GPU (cuda:LOCAL_RANK) under nccl."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if rank_backend() == "nccl" else torch.device("cpu")


def backend_env(world_size: int) -> dict[str, str]:
    """Environment of the launcher for the chosen backend; refuses NCCL without a GPU per rank."""
    if rank_backend() == "gloo":
        return {"CUDA_VISIBLE_DEVICES": ""}
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < world_size or not torch.distributed.is_nccl_available():
        message = (f"{BACKEND_ENV}=nccl: {world_size} ranks need {world_size} GPUs and NCCL; this machine has "
                   f"{gpus} GPU(s){'' if torch.distributed.is_nccl_available() else ' and no NCCL'}")
        if "pytest" in sys.modules:
            import pytest

            pytest.skip(message)
        raise BackendUnavailable(message)
    return {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# exit codes of a rank killed by one of these signals: a native crash, worth one rerun
NATIVE_CRASHES = {-int(s) for s in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)}
STATUS_FILE = "status.pkl"


def run_ranks(target: str, world_size: int, timeout_s: float = 120.0, env: dict[str, str] | None = None,
              allow_failures: bool = False, **kwargs: Any) -> list[Any]:
    """Run `target` ("module:function") on `world_size` ranks and return their results in rank order.

    With allow_failures, a failed rank's entry is a RankError instead of raising RankFailure. A run in
    which a rank crashed natively is repeated once (see the module docstring).
    """
    env = {**backend_env(world_size), **(env or {})}
    try:
        return _run_ranks_once(target, world_size, timeout_s, env, allow_failures, kwargs)
    except _NativeCrash as crash:
        warnings.warn(f"{target}: {crash}; running it once more", RuntimeWarning, stacklevel=2)
    try:
        return _run_ranks_once(target, world_size, timeout_s, env, allow_failures, kwargs)
    except _NativeCrash as crash:
        raise RankFailure(f"{target} crashed natively twice; the second time: {crash}") from None


class _NativeCrash(Exception):
    pass


def _run_ranks_once(target: str, world_size: int, timeout_s: float, env: dict[str, str] | None,
                    allow_failures: bool, kwargs: dict[str, Any]) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="meshtron-ranks-") as tmp:
        spec = Path(tmp) / "spec.pkl"
        spec.write_bytes(pickle.dumps({"target": target, "world_size": world_size, "kwargs": kwargs,
                                       "timeout_s": timeout_s, "out": tmp}))
        proc = subprocess.run([sys.executable, "-m", "meshtron.testing.multiprocess", str(spec)],
                              capture_output=True, text=True, timeout=timeout_s + 60,
                              env={**os.environ, **(env or {})})
        status_file = Path(tmp) / STATUS_FILE
        codes = pickle.loads(status_file.read_bytes()) if status_file.exists() else {}
        crashed = {r: c for r, c in codes.items() if c in NATIVE_CRASHES}
        if crashed:
            which = ", ".join(f"rank {r} died of {signal.Signals(-c).name}" for r, c in sorted(crashed.items()))
            raise _NativeCrash(f"{which}\nlauncher output:\n{proc.stderr[-4000:]}")
        results, errors = [], []
        for rank in range(world_size):
            ok, err = Path(tmp) / f"rank{rank}.pt", Path(tmp) / f"rank{rank}.err"
            if ok.exists():
                import torch

                results.append(torch.load(ok, weights_only=False))
                continue
            text = err.read_text() if err.exists() else "no result (the process exited or was killed)"
            errors.append(f"rank {rank}: {text}")
            results.append(RankError(text))
        if allow_failures:
            return results
        if errors or proc.returncode != 0:
            # the first error in full; the others by their last line (they usually repeat it)
            shown = errors[:1] + [e.strip().splitlines()[0] + " ... " + e.strip().splitlines()[-1] for e in errors[1:]]
            raise RankFailure("\n".join(shown) + f"\nlauncher exit {proc.returncode}\n{proc.stderr[-2000:]}")
        return results


def _run_rank(rank: int, spec: dict[str, Any], port: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(spec["world_size"]),
                       "LOCAL_WORLD_SIZE": str(spec["world_size"]), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    import faulthandler

    import torch

    faulthandler.enable()  # a native crash prints every thread's Python stack to the launcher's stderr
    torch.set_num_threads(1)
    if rank_backend() == "nccl":
        torch.cuda.set_device(rank)  # before any CUDA work: one GPU per rank, as torchrun's LOCAL_RANK
    out = Path(spec["out"])
    try:
        module, name = spec["target"].split(":")
        result = getattr(importlib.import_module(module), name)(rank, spec["world_size"], **spec["kwargs"])
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _launch(spec_path: str) -> int:
    spec = pickle.loads(Path(spec_path).read_bytes())
    importlib.import_module(spec["target"].split(":")[0])  # import, but run no torch op, before forking
    port = free_port()
    pids = []
    for rank in range(spec["world_size"]):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _run_rank(rank, spec, port)
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + spec["timeout_s"]
    status = {}
    while len(status) < len(pids):
        for pid in pids:
            if pid not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[pid] = os.waitstatus_to_exitcode(code)
        if time.monotonic() > deadline:
            for pid in pids:
                if pid not in status:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    status[pid] = -9
            break
        time.sleep(0.01)
    (Path(spec["out"]) / STATUS_FILE).write_bytes(pickle.dumps({r: status[pid] for r, pid in enumerate(pids)}))
    return 0 if all(c == 0 for c in status.values()) else 1


if __name__ == "__main__":
    sys.exit(_launch(sys.argv[1]))
