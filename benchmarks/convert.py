"""Conversion time and peak memory: streaming (tensor by tensor) against loading everything.

    python benchmarks/convert.py [--hidden-size 768 --layers 12 --ffn 2048 --vocab 12288] [--repeats 3]
                                 [--output benchmarks/results/convert.json]

A random Llama-shaped model (~104M parameters, fp32, by default) is written straight to safetensors
with a Llama config.json (transformers is not needed). Each measurement runs in a fresh process,
which reports its own peak RSS (ru_maxrss) and the wall time of the conversion call; a process that
only imports meshtron gives the baseline RSS subtracted in the table. Directions: hf-to-meshtron and
meshtron-to-hf, each streaming and load-all (every tensor and a full model in memory first).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

MODES = ("baseline", "hf-to-meshtron/streaming", "hf-to-meshtron/load-all", "meshtron-to-hf/streaming",
         "meshtron-to-hf/load-all")


def write_random_llama(directory: Path, hidden: int, layers: int, ffn: int, vocab: int, heads: int) -> dict:
    import torch

    from meshtron.models.hf.safetensors_io import TensorSpec, write_sharded

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads,
              "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "dtype": "float32"}
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,)})
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (hidden, hidden)
        shapes.update({f"{p}.mlp.gate_proj.weight": (ffn, hidden), f"{p}.mlp.up_proj.weight": (ffn, hidden),
                       f"{p}.mlp.down_proj.weight": (hidden, ffn)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    specs = [TensorSpec(n, s, torch.float32) for n, s in shapes.items()]
    generator = torch.Generator().manual_seed(0)
    write_sharded(directory, specs, lambda s: torch.randn(s.shape, generator=generator) * 0.02, 2 * 2**30)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return {"parameters": sum(s.nbytes for s in specs) // 4, "bytes": sum(s.nbytes for s in specs),
            "largest_tensor_bytes": max(s.nbytes for s in specs)}


def run_mode(mode: str, hf_dir: str, ckpt: str, out: str) -> None:
    """Child process: convert once, print {'seconds', 'peak_rss_bytes'} as JSON."""
    from meshtron.models.hf.convert import hf_to_meshtron, meshtron_to_hf

    start = time.perf_counter()
    if mode == "hf-to-meshtron/streaming":
        hf_to_meshtron(hf_dir, ckpt, streaming=True)
    elif mode == "hf-to-meshtron/load-all":
        hf_to_meshtron(hf_dir, ckpt, streaming=False)
    elif mode == "meshtron-to-hf/streaming":
        meshtron_to_hf(ckpt, out, streaming=True)
    elif mode == "meshtron-to-hf/load-all":
        meshtron_to_hf(ckpt, out, streaming=False)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    print(json.dumps({"seconds": seconds, "peak_rss_bytes": peak}))


def measure(mode: str, hf_dir: Path, work: Path) -> dict:
    ckpt, out = work / "ckpt", work / "out"
    if mode.startswith("hf-to-meshtron"):
        shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--child", mode, str(hf_dir), str(ckpt), str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        if argv[1] == "baseline":
            import meshtron.models.hf.convert  # noqa: F401  (imports only)
            print(json.dumps({"seconds": 0.0, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
            return 0
        run_mode(*argv[1:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=12288)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="benchmarks/results/convert.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshtron-convert-bench-") as tmp:
        work = Path(tmp)
        model = write_random_llama(work / "hf", args.hidden_size, args.layers, args.ffn, args.vocab, args.heads)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else (MODES[0], MODES[2], MODES[1], MODES[4], MODES[3])
            for mode in order:  # every hf-to-meshtron run leaves a checkpoint for the export runs after it
                runs[mode].append(measure(mode, work / "hf", work))
    baseline = statistics.median(r["peak_rss_bytes"] for r in runs["baseline"])
    summary = {}
    for mode in MODES[1:]:
        peak = statistics.median(r["peak_rss_bytes"] for r in runs[mode])
        summary[mode] = {"seconds": statistics.median(r["seconds"] for r in runs[mode]), "peak_rss_bytes": peak,
                         "peak_rss_above_baseline_bytes": peak - baseline}
    report = {"model": {**model, "hidden_size": args.hidden_size, "layers": args.layers, "ffn": args.ffn,
                        "vocab": args.vocab}, "baseline_rss_bytes": baseline, "summary": summary, "runs": runs,
              "repeats": args.repeats, "python": platform.python_version(), "machine": platform.machine()}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    mib = 2**20
    print(f"model: {model['parameters'] / 1e6:.1f}M parameters, {model['bytes'] / mib:.0f} MiB fp32, "
          f"largest tensor {model['largest_tensor_bytes'] / mib:.1f} MiB; baseline RSS {baseline / mib:.0f} MiB")
    print(f"{'mode':28s} {'seconds':>8s} {'peak RSS MiB':>13s} {'above baseline':>15s} {'x largest tensor':>17s}")
    for mode, row in summary.items():
        above = row["peak_rss_above_baseline_bytes"]
        print(f"{mode:28s} {row['seconds']:8.2f} {row['peak_rss_bytes'] / mib:13.0f} {above / mib:15.0f} "
              f"{above / model['largest_tensor_bytes']:17.1f}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
