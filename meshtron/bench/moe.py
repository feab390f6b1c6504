"""MoE sublayer throughput: against a dense MLP with the same active parameters, grouped against looped
experts, and what routing and the token dispatcher cost per token.

Cases, all on the same random input of `tokens` rows (batch x seq) and timed forward + backward
(training) and forward only:
  dense          MLP with ffn = topk * expert_ffn (the active matmul parameters of one MoE token)
  moe grouped    the MoE sublayer, experts as grouped GEMMs (`torch._grouped_mm`) where supported
  moe looped     the same sublayer and weights, one matmul per expert
Then, forward only, per token: the router (logits, top-k, balancing losses), the routing map, and
each dispatcher's dispatch + combine with an identity in place of the experts; the expert-parallel
dispatchers (all-gather, all-to-all) over --ep-sizes gloo ranks (meshtron/bench/moe_dispatch.py).
Repeats alternate the cases; the table shows medians and ratios to the dense MLP of the same run.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from meshtron.compat import grouped_mm_supported
from meshtron.config.schema import ModelConfig
from meshtron.nn.mlp import MLP
from meshtron.nn.moe import LocalDispatcher, MoELayer
from meshtron.nn.moe.routing_map import RowBound, build_routing_map

DEFAULT_OUTPUT = Path("benchmarks/results/moe.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Dispatchers measured by name; expert parallelism adds its own (they need a process group).
DISPATCHERS: dict[str, Callable[[], Any]] = {"local": LocalDispatcher}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="benchmarks/moe.py", description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--expert-ffn", type=int, default=1024, help="inner width of each expert")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds over all cases (median reported)")
    p.add_argument("--iters", type=int, default=3, help="calls per timed round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="auto: bf16 on CUDA, else fp32")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ep-sizes", default="2,4",
                   help="expert-parallel dispatcher cost over this many gloo ranks (comma list; '' skips), "
                        "see meshtron/bench/moe_dispatch.py")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], iters: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def build_layers(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    cfg = ModelConfig(hidden_size=args.hidden_size, num_attention_heads=1, num_moe_experts=args.num_experts,
                      moe_router_topk=args.topk, moe_ffn_hidden_size=args.expert_ffn, ffn_hidden_size=args.expert_ffn)
    cfg.validate()
    torch.manual_seed(args.seed)
    grouped = MoELayer(cfg)
    grouped.experts.init_weights(0.02, 0.02)
    looped = copy.deepcopy(grouped)
    looped.experts.grouped = False
    dense = MLP(args.hidden_size, args.topk * args.expert_ffn, "swiglu")
    return {name: m.to(device, dtype).train() for name, m in
            (("dense", dense), ("moe grouped", grouped), ("moe looped", looped))}


def time_layers(layers: dict[str, torch.nn.Module], x: torch.Tensor, args, device) -> dict[str, dict[str, list[float]]]:
    grad = torch.randn_like(x)

    def train_step(layer):
        xi = x.detach().requires_grad_()
        layer(xi).backward(grad)

    def forward(layer):
        with torch.no_grad():
            layer(x)

    times: dict[str, dict[str, list[float]]] = {n: {"train": [], "forward": []} for n in layers}
    for layer in layers.values():
        for _ in range(args.warmup):
            train_step(layer)
            forward(layer)
    for _ in range(args.repeats):  # alternate the cases, so a slow moment of the machine hits them alike
        for name, layer in layers.items():
            times[name]["train"].append(_time(lambda m=layer: train_step(m), args.iters, device))
            times[name]["forward"].append(_time(lambda m=layer: forward(m), args.iters, device))
    return times


def time_dispatch(layer: MoELayer, x: torch.Tensor, args, device) -> dict[str, list[float]]:
    """Forward-only seconds of routing, the routing map and each dispatcher's round trip."""
    tokens = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        probs, indices, _ = layer.router(x)
        routing = build_routing_map(probs, indices, layer.num_experts)
        steps: dict[str, Callable[[], Any]] = {
            "router": lambda: layer.router(x),
            "routing map": lambda: build_routing_map(probs, indices, layer.num_experts),
        }
        for name, make in DISPATCHERS.items():
            dispatcher = make()

            def round_trip(d=dispatcher):
                rows, _, handle = d.dispatch(tokens, routing.probs, routing.routing_map,
                                             row_bound=RowBound(layer.topk, layer.num_experts))
                return d.combine(rows, handle)

            steps[f"dispatch+combine ({name})"] = round_trip
        out: dict[str, list[float]] = {n: [] for n in steps}
        for fn in steps.values():
            for _ in range(args.warmup):
                fn()
        for _ in range(args.repeats):
            for name, fn in steps.items():
                out[name].append(_time(fn, args.iters, device))
    return out


def summarize(times: dict[str, dict[str, list[float]]], dispatch: dict[str, list[float]], num_tokens: int):
    rows = []
    base = {mode: statistics.median(times["dense"][mode]) for mode in ("train", "forward")}
    for name, modes in times.items():
        row: dict[str, Any] = {"case": name}
        for mode, values in modes.items():
            med = statistics.median(values)
            row[f"{mode}_ms"] = med * 1e3
            row[f"{mode}_tokens_per_s"] = num_tokens / med
            row[f"{mode}_vs_dense"] = base[mode] / med  # > 1: faster than the dense MLP
        rows.append(row)
    per_token = {name: statistics.median(v) / num_tokens * 1e9 for name, v in dispatch.items()}
    return rows, per_token


def print_table(rows: list[dict[str, Any]], per_token: dict[str, float], meta: dict[str, Any]) -> None:
    print(f"MoE sublayer: {meta['num_experts']} experts, top-{meta['topk']}, hidden {meta['hidden_size']}, "
          f"expert ffn {meta['expert_ffn']}; {meta['num_tokens']} tokens; {meta['device']} {meta['dtype']}; "
          f"grouped GEMM {'used' if meta['grouped_mm'] else 'not supported here (looped)'}")
    print(f"{'case':<14}{'train tok/s':>14}{'train ms':>11}{'vs dense':>10}{'fwd tok/s':>14}{'fwd ms':>10}{'vs dense':>10}")
    for r in rows:
        print(f"{r['case']:<14}{r['train_tokens_per_s']:>14.0f}{r['train_ms']:>11.2f}{r['train_vs_dense']:>10.2f}"
              f"{r['forward_tokens_per_s']:>14.0f}{r['forward_ms']:>10.2f}{r['forward_vs_dense']:>10.2f}")
    print("forward cost per token (median):")
    for name, ns in per_token.items():
        print(f"  {name:<28}{ns:>10.1f} ns")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    layers = build_layers(args, device, dtype)
    torch.manual_seed(args.seed + 1)
    x = torch.randn(args.batch_size, args.seq_length, args.hidden_size, device=device, dtype=dtype)
    num_tokens = args.batch_size * args.seq_length
    times = time_layers(layers, x, args, device)
    dispatch = time_dispatch(layers["moe grouped"], x, args, device)
    rows, per_token = summarize(times, dispatch, num_tokens)
    experts = layers["moe grouped"].experts
    meta = {"hidden_size": args.hidden_size, "expert_ffn": args.expert_ffn, "num_experts": args.num_experts,
            "topk": args.topk, "num_tokens": num_tokens, "device": device.type, "dtype": str(dtype).split(".")[-1],
            "grouped_mm": grouped_mm_supported(x.reshape(-1, args.hidden_size), experts.w_up.transpose(1, 2)),
            "threads": torch.get_num_threads(), "repeats": args.repeats, "iters": args.iters,
            "torch": torch.__version__, "machine": platform.machine(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    print_table(rows, per_token, meta)
    result = {"settings": meta, "cases": rows, "per_token_ns": per_token,
              "raw_s": {"layers": times, "dispatch": dispatch}}
    ep_sizes = [int(v) for v in args.ep_sizes.split(",") if v.strip()]
    if ep_sizes:
        from meshtron.bench.moe_dispatch import measure, print_rows

        result["ep_dispatch"] = measure(ep_sizes, tokens=num_tokens, hidden_size=args.hidden_size,
                                        num_experts=args.num_experts, topk=args.topk, repeats=args.repeats,
                                        iters=args.iters, warmup=args.warmup)
        print_rows(result["ep_dispatch"])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0
