"""The processes of `meshtron bench hostile` besides the good clients: the server under test (`python
-m meshtron serve` of a tiny random checkpoint on 127.0.0.1, with its CPU time, resident memory and
log) and the hostile client (a spawned process, so its work never shares the good clients' event
loop); what the engine still holds after a phase, and the git commit the server ran from.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import queue
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from meshtron.bench.hostile_cases import CaseRecord, hostile_process

REPO_ROOT = Path(__file__).resolve().parents[2]
SETTLE_S = 10.0  # after a phase, how long the engine gets to finish aborted work before stats are read


def save_checkpoint(directory: Path, args: argparse.Namespace) -> None:
    """A random Llama-shaped model with the byte tokenizer, saved as the trainer saves one."""
    import torch
    import yaml

    from meshtron.checkpoint import CheckpointManager
    from meshtron.config.loader import config_to_dict
    from meshtron.config.schema import ModelConfig, RunConfig
    from meshtron.models import GPTModel

    torch.manual_seed(args.seed)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden_size, num_attention_heads=args.heads,
                      ffn_hidden_size=args.ffn, max_position_embeddings=args.max_len, make_vocab_size_divisible_by=1,
                      init_method_std=0.2)
    model = GPTModel(cfg, 262).eval()  # the byte tokenizer's vocabulary
    run_cfg = RunConfig(model=model.cfg)
    run_cfg.tokenizer.type = "byte"
    CheckpointManager(directory).save(0, model, None, {"step": 0}, yaml.safe_dump(config_to_dict(run_cfg)))


class Server:
    """`python -m meshtron serve` on 127.0.0.1 at a free port, its log in a file."""

    def __init__(self, checkpoint: Path, log_path: Path, threads: int, extra: tuple[str, ...] = ()):
        from meshtron.testing.multiprocess import free_port

        self.port, self.log_path = free_port(), log_path
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshtron", "serve", "--checkpoint", str(checkpoint), "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", "--kv-cache-memory-mb", "64", *extra],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited {self.proc.returncode} at start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"the server was not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def rss_mib(self) -> Optional[float]:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return None  # not Linux, or the process is gone

    def cpu_s(self) -> Optional[float]:
        """User + system CPU seconds of the server process so far (Linux; None elsewhere)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> Optional[int]:
        """SIGTERM (a drain), then the exit status; killed after 60 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()
        return self.proc.returncode


class HostileClient:
    """The hostile client of one B phase, in a spawned process of its own (hostile_cases.hostile_process)."""

    def __init__(self, spec: dict[str, Any]):
        """`spec`: the arguments of hostile_process (url, case names, max_model_len, timeout_s, expected,
        max_tokens, long_tokens, min_rounds)."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may have run torch ops
        self.stop, self.results = ctx.Event(), ctx.Queue()
        # the longest it may take to stop: every case (the shared-id pair counts twice) timing out
        self.bound_s = (len(spec["names"]) + 1) * spec["timeout_s"] * max(1, spec["min_rounds"]) + 60
        self.proc = ctx.Process(target=hostile_process, args=(spec, self.stop, self.results), daemon=True,
                                name="meshtron-hostile")
        self.proc.start()

    def _next(self, timeout_s: float) -> tuple:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise SystemExit(f"the hostile client's process exited {self.proc.exitcode} without a result") from None
        self.proc.terminate()
        raise SystemExit(f"the hostile client did not answer within {timeout_s:.0f} s")

    def wait_ready(self) -> None:
        assert self._next(120.0) == ("ready",)

    def finish(self, records: dict[str, CaseRecord]) -> int:
        """Stop after the current case (and --min-hostile-rounds rounds); merge its records; -> requests made."""
        self.stop.set()
        _, child_records, num_requests = self._next(self.bound_s)
        for name, record in child_records.items():
            records[name].merge(record)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.terminate()
        return num_requests


def server_cpu_s(server: Optional[Server]) -> Optional[float]:
    return server.cpu_s() if server is not None else None


async def server_after_phase(url: str, server: Optional[Server]) -> dict[str, Any]:
    """Once the engine has settled: /health, what the engine still holds (requests and KV blocks that
    should have been freed) and the server's resident memory (of a server started here)."""
    import httpx

    if server is not None and server.proc.poll() is not None:
        return {"alive": False, "exit_code": server.proc.returncode}
    out: dict[str, Any] = {"alive": True}
    deadline = time.monotonic() + SETTLE_S
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        try:
            while True:
                stats = (await client.get("/v1/engine/stats")).json()
                # stats are read without the engine's lock: wait for the blocks too, not just the queues
                idle = stats["num_running"] == stats["num_waiting"] == 0
                if (idle and stats["num_free_blocks"] == stats["num_blocks"]) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            out["health"] = (await client.get("/health")).status_code
        except (httpx.HTTPError, ValueError, KeyError) as e:
            return {"alive": server is not None, "health": None, "error": f"{type(e).__name__}: {e}"}
    out.update(num_running=stats["num_running"], num_waiting=stats["num_waiting"],
               leaked_blocks=stats["num_blocks"] - stats["num_free_blocks"],
               rss_mib=server.rss_mib() if server is not None else None)
    return out


def git_state() -> dict[str, Any]:
    """The commit the server ran from and any uncommitted change to the package (None outside git)."""
    def git(*argv: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(REPO_ROOT), *argv], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", "meshtron")
    return {"commit": git("log", "-1", "--oneline"),
            "uncommitted": status.splitlines() if status else ([] if status is not None else None)}


def log_summary(text: str) -> dict[str, Any]:
    """Tracebacks and error lines in the server's log (it runs at --log-level warning)."""
    lines = text.splitlines()
    tracebacks = sum(line.startswith("Traceback") for line in lines)
    errors = sum("ERROR" in line for line in lines)
    return {"lines": len(lines), "tracebacks": tracebacks, "error_lines": errors,
            "tail": text[-3000:] if tracebacks or errors else ""}
