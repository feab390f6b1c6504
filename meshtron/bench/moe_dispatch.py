"""What the expert-parallel token dispatchers cost per token: all-gather and all-to-all over `ep` gloo
ranks, against the local dispatcher (no exchange) on the same tokens and routing.

Each of `ep` ranks routes its own random tokens (a real top-k router, dropless) and times
dispatch + combine with an identity in place of the experts: forward only, and forward + backward.
A round's time is the slowest rank's (the collectives finish together), between device
synchronisations on CUDA; the median over rounds is reported per token of one rank, with the rows each
rank sends. Dispatchers get the routing map's row bound, as in the MoE layer. Ranks are CPU processes on gloo with
one thread each (`meshtron.testing.multiprocess`): the numbers compare the dispatchers' work and
traffic on this machine, not an NVLink/InfiniBand fabric.

`measure(...)` returns the rows; benchmarks/moe.py prints and saves them with its own results.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any

DISPATCH_CASES = ("local", "allgather", "alltoall")


def measure(ep_sizes: list[int], *, tokens: int, hidden_size: int, num_experts: int, topk: int,
            repeats: int = 5, iters: int = 3, warmup: int = 2, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """One row per (ep, dispatcher): per-token ns forward and forward+backward, rows sent per rank."""
    from meshtron.testing.multiprocess import run_ranks

    rows = []
    for ep in ep_sizes:
        if num_experts % ep:
            raise ValueError(f"--ep-sizes: {ep} must divide --num-experts {num_experts}")
        results = run_ranks("meshtron.bench.moe_dispatch:rank_main", ep, timeout_s=timeout_s, tokens=tokens,
                            hidden_size=hidden_size, num_experts=num_experts, topk=topk, repeats=repeats,
                            iters=iters, warmup=warmup)
        for case in DISPATCH_CASES:
            row: dict[str, Any] = {"ep": ep, "dispatcher": case, "tokens_per_rank": tokens}
            for mode in ("forward", "train"):
                slowest = [max(r[case][mode][i] for r in results) for i in range(repeats)]
                row[f"{mode}_ns_per_token"] = statistics.median(slowest) / tokens * 1e9
            row["rows_sent_per_rank"] = statistics.mean(r[case]["rows_sent"] for r in results)
            rows.append(row)
        local = {m: next(r for r in rows if r["ep"] == ep and r["dispatcher"] == "local")[f"{m}_ns_per_token"]
                 for m in ("forward", "train")}
        for r in rows:
            if r["ep"] == ep:
                for m in ("forward", "train"):
                    r[f"{m}_vs_local"] = r[f"{m}_ns_per_token"] / local[m]  # > 1: slower than no exchange
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print("expert-parallel dispatch + combine (identity experts), per token of one rank; gloo CPU ranks, 1 thread:")
    print(f"{'ep':>4} {'dispatcher':<11}{'fwd ns/tok':>12}{'vs local':>10}{'fwd+bwd ns/tok':>16}{'vs local':>10}"
          f"{'rows sent/rank':>16}")
    for r in rows:
        print(f"{r['ep']:>4} {r['dispatcher']:<11}{r['forward_ns_per_token']:>12.0f}{r['forward_vs_local']:>10.2f}"
              f"{r['train_ns_per_token']:>16.0f}{r['train_vs_local']:>10.2f}{r['rows_sent_per_rank']:>16.0f}")


def rank_main(rank: int, world: int, *, tokens: int, hidden_size: int, num_experts: int, topk: int,
              repeats: int, iters: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtron.config.schema import ModelConfig
    from meshtron.nn.moe import LocalDispatcher, MoELayer
    from meshtron.nn.moe.routing_map import RowBound, build_routing_map
    from meshtron.parallel.dims import backend_options
    from meshtron.parallel.expert_parallel import DISPATCHERS

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",),
                            backend_override={"ep": backend_options("cpu", 300)})
    cfg = ModelConfig(hidden_size=hidden_size, num_attention_heads=1, num_moe_experts=num_experts,
                      moe_router_topk=topk, ffn_hidden_size=hidden_size)
    cfg.validate()
    torch.manual_seed(0)
    router = MoELayer(cfg).router
    torch.manual_seed(1 + rank)
    x = torch.randn(1, tokens, hidden_size)  # collective-device: this benchmark runs gloo ranks on the CPU
    with torch.no_grad():
        probs, indices, _ = router(x)
    routing = build_routing_map(probs, indices, num_experts)
    tokens_2d = x.reshape(tokens, hidden_size)
    grad = torch.randn_like(tokens_2d)
    dispatchers = {"local": LocalDispatcher(),
                   **{name: DISPATCHERS[name](mesh["ep"].get_group(), num_experts) for name in ("allgather", "alltoall")}}

    bound = RowBound(topk, num_experts)  # what the MoE layer passes: buffers sized without a host read

    def forward(d):
        with torch.no_grad():
            rows, _, handle = d.dispatch(tokens_2d, routing.probs, routing.routing_map, row_bound=bound)
            d.combine(rows, handle)

    def train(d):
        t = tokens_2d.detach().requires_grad_()
        p = routing.probs.detach().requires_grad_()
        rows, _, handle = d.dispatch(t, p, routing.routing_map, row_bound=bound)
        d.combine(rows, handle).backward(grad)

    out: dict[str, Any] = {}
    for name, d in dispatchers.items():
        for _ in range(warmup):
            forward(d)
            train(d)
        out[name] = {"forward": [], "train": [], "rows_sent": _rows_sent(name, routing.routing_map, rank, world,
                                                                          num_experts, tokens)}
    for _ in range(repeats):  # alternate the cases: a slow moment of the machine hits them alike
        for name, d in dispatchers.items():
            out[name]["forward"].append(timed(lambda d=d: forward(d), iters, tokens_2d.device, dist.barrier))
            out[name]["train"].append(timed(lambda d=d: train(d), iters, tokens_2d.device, dist.barrier))
    return out


def timed(fn, iters: int, device, barrier) -> float:
    """Seconds per call of `fn`, from a barrier of the ranks to the end of the device's work."""
    synchronize(device)  # queued GPU work would otherwise land in (or outside) the window
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; CPU work is done when it returns)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rows_sent(name: str, routing_map, rank: int, world: int, num_experts: int, tokens: int) -> float:
    """Hidden-state rows this rank sends to other ranks in dispatch (combine returns as many)."""
    if name == "local":
        return 0.0
    if name == "allgather":
        return float(tokens * (world - 1))
    per_rank = routing_map.sum(0).view(world, num_experts // world).sum(1)
    return float(per_rank.sum() - per_rank[rank])
