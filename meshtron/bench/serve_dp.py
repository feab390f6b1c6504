"""`benchmarks/serve_parallel.py --mode dp`: data-parallel replicas behind one endpoint against one
replica, at equal total threads, end to end through HTTP.

The same seeded model is saved as a checkpoint and served three ways, each a `meshtron serve` process
(the replicas its own processes): `single`, one engine in the server process with dp x threads
intra-op threads; `dp1`, the data-parallel front with one replica of dp x threads threads (the
front's own cost: the coordinator hop and the re-built outputs); `dp{N}`, N replicas of `--threads`
threads each. Every request of the fixed workload is sent at once (token-id prompts, greedy, eos
ignored, so each makes its drawn number of tokens); throughput is output tokens over the wall time
from the first send to the last answer. OMP_WAIT_POLICY is PASSIVE unless the environment sets it. The servers' answers must agree (checked). Runs alternate
between the systems and the medians are reported (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


def save_checkpoint(model, directory: Path) -> str:
    import yaml

    from meshtron.checkpoint import CheckpointManager
    from meshtron.config.loader import config_to_dict
    from meshtron.config.schema import RunConfig

    cfg = RunConfig(model=model.cfg)
    cfg.tokenizer.type = "byte"
    CheckpointManager(directory).save(0, model, None, {"step": 0}, yaml.safe_dump(config_to_dict(cfg)))
    return str(directory)


def start_server(checkpoint: str, port: int, engine_flags: list[str], dp: int, threads: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "meshtron", "serve", "--checkpoint", checkpoint, "--port", str(port),
               "--log-level", "warning", *engine_flags]
    if dp:
        command += ["--dp", str(dp), "--replica-threads", str(threads)]
    # the one-engine server computes with its own threads; a front only tokenizes and routes. Idle
    # OpenMP threads sleep rather than spin: on a shared machine a spinning team of the one-engine
    # server (its engine steps in a thread of its own) made it 50x slower than the replicas.
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "OMP_NUM_THREADS": str(1 if dp else threads)}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server at {url} was not ready within {timeout_s:g} s")


async def send_all(url: str, prompts: list[list[int]], outputs: list[int]) -> tuple[float, list[str]]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        await client.post("/v1/completions", json={"prompt": prompts[0][:4], "max_tokens": 2})  # warm-up
        start = time.perf_counter()
        answers = await asyncio.gather(*[client.post("/v1/completions", json={
            "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}) for p, n in zip(prompts, outputs)])
        wall = time.perf_counter() - start
    for a in answers:
        a.raise_for_status()
    return wall, [a.json()["choices"][0]["text"] for a in answers]


def run_system(checkpoint: str, engine_flags: list[str], dp: int, threads: int, prompts, outputs) -> tuple[float, list]:
    from meshtron.testing.multiprocess import free_port

    port = free_port()
    proc = start_server(checkpoint, port, engine_flags, dp, threads)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        return asyncio.run(send_all(f"http://127.0.0.1:{port}", prompts, outputs))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def mode_dp(args: argparse.Namespace) -> dict[str, Any]:
    from meshtron.bench.serve_parallel import build_model, build_workload

    max_len = args.prompt_len[1] + args.output_len[1]
    prompts, outputs = build_workload(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len))
    tokens = sum(outputs)
    engine_flags = ["--device", "cpu", "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                    str(args.max_num_batched_tokens), "--block-size", "16",
                    "--num-blocks", str(args.num_requests * -(-max_len // 16))]
    total = args.dp * args.threads
    systems = {"single": (0, total), "dp1": (1, total), f"dp{args.dp}": (args.dp, args.threads)}
    walls: dict[str, list[float]] = {name: [] for name in systems}
    texts: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="meshtron-serve-dp-") as tmp:
        checkpoint = save_checkpoint(build_model(args.layers, args.hidden_size, args.heads, max_len, args.seed),
                                     Path(tmp) / "model")
        for _ in range(args.repeats):
            for name, (dp, threads) in systems.items():
                wall, answers = run_system(checkpoint, engine_flags, dp, threads, prompts, outputs)
                walls[name].append(wall)
                texts.setdefault(name, answers)
    single = statistics.median(walls["single"])
    rows = [{"system": name, "wall_s": round(statistics.median(w), 3),
             "output_tokens_per_s": round(tokens / statistics.median(w), 1),
             "vs_single": round(single / statistics.median(w), 3), "walls": [round(x, 3) for x in w]}
            for name, w in walls.items()]
    return {"mode": "dp", "rows": rows, "same_tokens": all(t == texts["single"] for t in texts.values()),
            "output_tokens": tokens,
            "note": f"dp{args.dp}: {args.dp} replicas x {args.threads} thread(s); single and dp1: one engine with "
                    f"{total} threads (dp1 behind the data-parallel front); all through HTTP, {args.num_requests} "
                    f"requests sent at once; machine: {os.cpu_count()} CPUs, torch {torch.__version__}"}
