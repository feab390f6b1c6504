"""Serving past one process: the throughput a parallel layout gets against one process at equal total threads.

    --mode pp   pipeline-parallel serving (`meshtron.inference.pipeline_engine`): `--pp` stages, one
                process each with `--threads` intra-op threads, against one process with pp x threads
                threads, on the same seeded offline workload (every request arrives at t=0, greedy, eos
                ignored so every request makes its drawn number of tokens). The ratio is the pipeline's
                cost: the hidden states sent between stages, idle stages when fewer requests run than
                steps are in flight, and smaller matrix products per process.
                Also run: the pipeline one step at a time (`sync`, each stage busy 1 / pp of the time),
                unsplit and cut into pp micro-batches, to show what the steps in flight buy.
                Both runs must produce the same tokens (checked). The stages run on gloo ranks of one
                machine (`meshtron.testing.multiprocess.run_ranks`), so the transfers are local copies.
    --mode dp   data-parallel replicas behind one HTTP endpoint (`meshtron serve --dp`): `--dp` replica
                processes with `--threads` threads each, against one engine with dp x threads threads,
                all through HTTP (meshtron/bench/serve_dp.py).

Each run is repeated `--repeats` times, single and pipelined alternating, and the median wall time is
reported (the machine may be shared). Output: a table and JSON (`--output`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch

DEFAULT_OUTPUT = Path("benchmarks/results/serve_parallel.json")


def build_workload(num_requests: int, seed: int, prompt_range: tuple[int, int],
                   output_range: tuple[int, int]) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        n = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (1,), generator=g))
        prompts.append(torch.randint(0, 256, (n,), generator=g).tolist())
        outputs.append(int(torch.randint(output_range[0], output_range[1] + 1, (1,), generator=g)))
    return prompts, outputs


def build_model(layers: int, hidden: int, heads: int, max_len: int, seed: int):
    from meshtron.config.schema import ModelConfig
    from meshtron.models import GPTModel

    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, max_position_embeddings=max_len,
                      make_vocab_size_divisible_by=1, init_method_std=0.1)
    return GPTModel(cfg, 262).eval()  # the byte tokenizer's vocabulary


def _params(outputs: list[int]):
    from meshtron.inference.request import SamplingParams

    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outputs]


def _engine_config(spec: dict[str, Any], micro_batches: int = 0):
    from meshtron.inference.config import EngineConfig

    return EngineConfig(device="cpu", max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_batched"],
                        num_blocks=spec["num_blocks"], block_size=16, pp_micro_batches=micro_batches)


def _timed_generate(engine, prompts, outputs) -> tuple[float, list[list[int]], float]:
    """-> (wall seconds, tokens, CPU seconds of this process) of the workload, after a warm-up."""
    engine.generate(prompts[:2], _params([2, 2]))  # warm-up: kernels, allocations
    start, cpu = time.perf_counter(), time.process_time()
    out = engine.generate(prompts, _params(outputs))
    return time.perf_counter() - start, [o.token_ids for o in out], time.process_time() - cpu


def run_single(spec: dict[str, Any], prompts, outputs, threads: int) -> tuple[float, list[list[int]], float]:
    from meshtron.data.tokenizer import ByteTokenizer
    from meshtron.inference.engine import LLMEngine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(spec["layers"], spec["hidden"], spec["heads"], spec["max_len"], spec["seed"])
        return _timed_generate(LLMEngine(model, ByteTokenizer(), _engine_config(spec)), prompts, outputs)
    finally:
        torch.set_num_threads(before)


def pp_rank(rank: int, world_size: int, spec: dict[str, Any], prompts, outputs, threads: int, micro_batches: int,
            depth: int):
    """One stage of the pipeline (run_ranks target): the leader returns (wall seconds, tokens)."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshtron.data.tokenizer import ByteTokenizer
    from meshtron.inference.pipeline_engine import build_pipeline_member
    from meshtron.inference.tp_serving import Leader, lead
    from meshtron.parallel.dims import ParallelDims

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=world_size, ep=1, world_size=world_size)
    mesh = dims.build_mesh("cpu", 600)
    model = build_model(spec["layers"], spec["hidden"], spec["heads"], spec["max_len"], spec["seed"])
    member = build_pipeline_member(model, ByteTokenizer(), _engine_config(spec, micro_batches),
                                   pp_group=mesh["pp"].get_group(), timeout_s=600)
    # a warm-up generation, then the timed one; every rank measures its own CPU seconds over the timed
    # one (CPU time, unlike wall time, hardly depends on what else the machine runs)
    if not member.is_leader:
        member.follow()
        dist.barrier(group=member.messages.group)
        cpu = time.process_time()
        member.follow()
        return time.process_time() - cpu
    engine = lead(member.engine, Leader(member.messages))
    engine.depth = depth  # steps in flight at once: pp (the default), or 1 (one step through the stages at a time)
    engine.generate(prompts[:2], _params([2, 2]))
    engine.step_hook("stop")
    dist.barrier(group=member.messages.group)
    engine.step_hook = Leader(member.messages)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        out = engine.generate(prompts, _params(outputs))
        return time.perf_counter() - start, [o.token_ids for o in out], time.process_time() - cpu
    finally:
        engine.shutdown()


def run_pipeline(spec: dict[str, Any], prompts, outputs, pp: int, threads: int, micro_batches: int,
                 depth: int) -> tuple[float, list[list[int]], list[float]]:
    """-> (wall seconds, tokens, CPU seconds of each stage)."""
    from meshtron.testing.multiprocess import run_ranks

    results = run_ranks("meshtron.bench.serve_parallel:pp_rank", pp, timeout_s=1800, spec=spec, prompts=prompts,
                        outputs=outputs, threads=threads, micro_batches=micro_batches, depth=depth)
    wall, tokens, cpu = results[-1]  # the leader: the last stage
    return wall, tokens, [*results[:-1], cpu]


def mode_pp(args: argparse.Namespace) -> dict[str, Any]:
    spec = {"layers": args.layers, "hidden": args.hidden_size, "heads": args.heads, "seed": args.seed,
            "max_len": args.prompt_len[1] + args.output_len[1], "max_num_seqs": args.max_num_seqs,
            "max_batched": args.max_num_batched_tokens,
            "num_blocks": args.num_requests * -(-(args.prompt_len[1] + args.output_len[1]) // 16)}
    prompts, outputs = build_workload(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len))
    tokens = sum(outputs)
    # (name, steps in flight, micro-batches per step)
    variants = [(f"pp{args.pp}", args.pp, args.micro_batches or 1), (f"pp{args.pp} sync", 1, 1),
                (f"pp{args.pp} sync m={args.pp}", 1, args.pp)]
    singles = args.single_threads or [args.pp * args.threads]
    walls: dict[str, list[float]] = {**{f"single {t} thr": [] for t in singles}, **{name: [] for name, _, _ in variants}}
    cpus: dict[str, list[list[float]]] = {name: [] for name in walls}  # per run: CPU seconds of each process
    reference, agree = None, True
    for _ in range(args.repeats):
        for t in singles:
            wall, out, cpu = run_single(spec, prompts, outputs, t)
            walls[f"single {t} thr"].append(wall)
            cpus[f"single {t} thr"].append([cpu])
            agree = agree and (reference is None or out == reference)
            reference = reference or out
        for name, depth, m in variants:
            wall, out, cpu = run_pipeline(spec, prompts, outputs, args.pp, args.threads, m, depth)
            walls[name].append(wall)
            cpus[name].append(cpu)
            agree = agree and out == reference
    rows = []
    ref = f"single {singles[0]} thr"
    single = statistics.median(walls[ref])
    single_cpu = statistics.median(sum(c) for c in cpus[ref])
    overlapping = {name for name, depth, _ in variants if depth > 1}
    for name, w in walls.items():
        wall = statistics.median(w)
        total_cpu = statistics.median(sum(c) for c in cpus[name])
        # with steps in flight the stages overlap: wall time >= the busiest stage's CPU time; one step at
        # a time they take turns (micro-batches overlap only within a step): wall time ~ the total
        busiest = statistics.median(max(c) for c in cpus[name]) if name in overlapping else total_cpu
        rows.append({"system": name, "wall_s": round(wall, 3), "output_tokens_per_s": round(tokens / wall, 1),
                     "vs_single": round(single / wall, 3), "walls": [round(x, 6) for x in w],
                     # CPU seconds: all processes together (the work, overhead included) and the busiest
                     # process (the bound on wall time with every stage on a core of its own)
                     "cpu_s": round(total_cpu, 3), "cpu_vs_single": round(total_cpu / single_cpu, 3),
                     "busiest_cpu_s": round(busiest, 3), "bound_vs_single": round(single_cpu / busiest, 3),
                     "cpus": [[round(x, 3) for x in c] for c in cpus[name]]})
    return {"mode": "pp", "rows": rows, "same_tokens": agree, "output_tokens": tokens,
            "note": f"{args.pp} stages x {args.threads} thread(s) against one process with {singles[0]} thread(s); "
                    f"pp{args.pp}: {args.pp} steps in flight; sync: one step through the stages at a time "
                    f"(m: micro-batches per step); cpu: CPU seconds of all processes, x single; bound: the speed-up "
                    f"with a core per stage, single's CPU seconds / the busiest process's with steps in flight, "
                    f"/ the total one step at a time"}


def mode_dp(args: argparse.Namespace) -> dict[str, Any]:
    from meshtron.bench.serve_dp import mode_dp as run

    return run(args)


MODES = {"pp": mode_pp, "dp": mode_dp}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="serve_parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=sorted(MODES), default="pp", help="which layout to measure (default pp)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--micro-batches", type=int, default=0, help="micro-batches per step of the pipeline (0: 1); "
                                                                "one step at a time (m=1, m=pp) is run too, "
                                                                "to show what steps in flight buy")
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas (--mode dp; default 2)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads per stage or replica process (default 1)")
    p.add_argument("--single-threads", type=int, nargs="+", default=None, metavar="T",
                   help="--mode pp: threads of the one-process runs, the first the reference of the ratios "
                        "(default: pp x threads, equal total threads)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON results (default {DEFAULT_OUTPUT})")
    return p


def print_table(result: dict[str, Any]) -> None:
    cpu = "cpu_s" in result["rows"][0]
    extra = f" {'cpu s':>8} {'cpu x':>7} {'bound':>7}" if cpu else ""
    print(f"{'system':<18} {'wall s':>8} {'out tok/s':>10} {'vs single':>10}" + extra)
    for r in result["rows"]:
        extra = f" {r['cpu_s']:>8.3f} {r['cpu_vs_single']:>7.3f} {r['bound_vs_single']:>7.3f}" if cpu else ""
        print(f"{r['system']:<18} {r['wall_s']:>8.3f} {r['output_tokens_per_s']:>10.1f} {r['vs_single']:>10.3f}" + extra)
    print(result["note"])
    if "same_tokens" in result:
        print("same tokens as the single process:", "yes" if result["same_tokens"] else "NO")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    result = MODES[args.mode](args)
    result.update(args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  machine={"platform": platform.platform(), "cpus": torch.get_num_threads(),
                           "torch": torch.__version__})
    print_table(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(args.output.read_text()) if args.output.exists() else {}
    existing[args.mode] = result
    args.output.write_text(json.dumps(existing, indent=1) + "\n")
    return 0 if result.get("same_tokens", True) else 1
