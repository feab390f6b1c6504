"""Conversion time and peak memory: streaming (tensor by tensor) against loading everything.

    python benchmarks/convert.py [--hidden-size 768 --layers 12 --ffn 2048 --vocab 12288] [--repeats 3]
                                 [--output benchmarks/results/convert.json]

A random Llama-shaped model (~104M parameters, fp32, by default) is written straight to safetensors
with a Llama config.json (transformers is not needed). Each measurement runs in a fresh process:
after the imports it notes its resident memory and resets the kernel's high-water mark
(/proc/self/clear_refs), runs the conversion, and reports the wall time and the peak resident memory
reached during the conversion above where it started. Directions: hf-to-meshtron and meshtron-to-hf,
each streaming and load-all (every tensor and a full model in memory first).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

MODES = ("hf-to-meshtron/streaming", "hf-to-meshtron/load-all", "meshtron-to-hf/streaming", "meshtron-to-hf/load-all")


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


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status (this benchmark needs Linux)")


def timed_conversion(convert: Callable[[], object]) -> None:
    """Child process: run `convert` once, print {'seconds', 'start_rss_bytes', 'peak_rss_bytes'} as JSON."""
    start_rss = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS: imports do not count
    start = time.perf_counter()
    convert()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "start_rss_bytes": start_rss, "peak_rss_bytes": status_bytes("VmHWM")}))


def run_child(script: str, mode: str, *paths: Path) -> dict:
    """`script --child mode paths...` in a fresh interpreter -> the JSON its `timed_conversion` printed."""
    cmd = [sys.executable, script, "--child", mode, *map(str, paths)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def add_shape_arguments(parser: argparse.ArgumentParser, output: str) -> None:
    """The model shape (default: a ~100M-parameter Llama) and the run's options, shared by the converter benchmarks."""
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=12288)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=output)


def run_mode(mode: str, hf_dir: str, ckpt: str, out: str) -> None:
    from meshtron.models.hf.convert import hf_to_meshtron, meshtron_to_hf

    streaming = mode.endswith("/streaming")
    if mode.startswith("hf-to-meshtron"):
        timed_conversion(lambda: hf_to_meshtron(hf_dir, ckpt, streaming=streaming))
    else:
        timed_conversion(lambda: meshtron_to_hf(ckpt, out, streaming=streaming))


def measure(mode: str, hf_dir: Path, work: Path) -> dict:
    ckpt, out = work / "ckpt", work / "out"
    if mode.startswith("hf-to-meshtron"):
        shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return run_child(__file__, mode, hf_dir, ckpt, out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        run_mode(*argv[1:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser, "benchmarks/results/convert.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshtron-convert-bench-") as tmp:
        work = Path(tmp)
        model = write_random_llama(work / "hf", args.hidden_size, args.layers, args.ffn, args.vocab, args.heads)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else (MODES[1], MODES[0], MODES[3], MODES[2])
            for mode in order:  # every hf-to-meshtron run leaves a checkpoint for the export runs after it
                runs[mode].append(measure(mode, work / "hf", work))
    summary = {}
    for mode in MODES:
        summary[mode] = {"seconds": statistics.median(r["seconds"] for r in runs[mode]),
                         "start_rss_bytes": statistics.median(r["start_rss_bytes"] for r in runs[mode]),
                         "peak_rss_above_start_bytes": statistics.median(r["peak_rss_bytes"] - r["start_rss_bytes"]
                                                                         for r in runs[mode])}
    report = {"model": {**model, "hidden_size": args.hidden_size, "layers": args.layers, "ffn": args.ffn,
                        "vocab": args.vocab}, "summary": summary, "runs": runs,
              "repeats": args.repeats, "python": platform.python_version(), "machine": platform.machine()}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    mib = 2**20
    print(f"model: {model['parameters'] / 1e6:.1f}M parameters, {model['bytes'] / mib:.0f} MiB fp32, "
          f"largest tensor {model['largest_tensor_bytes'] / mib:.1f} MiB ({args.repeats} runs each, medians)")
    print(f"{'mode':28s} {'seconds':>8s} {'RSS at start MiB':>17s} {'peak above start MiB':>21s} "
          f"{'x largest tensor':>17s} {'x model':>8s}")
    for mode, row in summary.items():
        above = row["peak_rss_above_start_bytes"]
        print(f"{mode:28s} {row['seconds']:8.2f} {row['start_rss_bytes'] / mib:17.0f} {above / mib:21.0f} "
              f"{above / model['largest_tensor_bytes']:17.1f} {above / model['bytes']:8.2f}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
