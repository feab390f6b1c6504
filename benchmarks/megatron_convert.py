"""Megatron Core torch_dist <-> meshtron conversion: time and peak memory against the largest tensor.

    python benchmarks/megatron_convert.py [--hidden-size 768 --layers 12 --heads 12 --ffn 2048 --vocab 12288]
                                          [--repeats 3] [--output benchmarks/results/megatron_convert.json]

megatron-core builds a random GPTModel (local layer spec: RMSNorm, SwiGLU, RoPE, untied; ~104M
parameters, fp32, by default: the shape of benchmarks/convert.py's Llama, so the numbers sit next to
the Hugging Face converter's) on the CPU and saves it with `dist_checkpointing.save` (torch_dist), in
the Megatron-LM layout. Each measurement then runs in a fresh process that imports meshtron only:
after the imports it notes its resident memory and resets the kernel's high-water mark
(/proc/self/clear_refs), converts, and reports the wall time and the peak resident memory above
where it started. Directions: megatron-to-meshtron, then meshtron-to-megatron of its output.
Needs megatron-core (a test extra) for the first step only.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

MODES = ("megatron-to-meshtron", "meshtron-to-megatron")


def write_random_megatron(save_dir: Path, hidden: int, layers: int, heads: int, ffn: int, vocab: int) -> dict:
    """A megatron-core GPTModel with random weights saved as torch_dist; its sizes."""
    import torch

    from tests.models.megatron import megatron_harness as mh  # the CPU workarounds megatron-core needs

    with mh.cpu_megatron():
        torch.manual_seed(0)
        model = mh.build_gpt(False, vocab=vocab, max_len=2048, layers=layers, hidden=hidden, heads=heads,
                             groups=heads, ffn=ffn)
        mh.save_megatron(model, save_dir, mh.megatron_args(model, False, max_len=2048), iteration=1000)
        tensors = [p for p in model.state_dict().values() if isinstance(p, torch.Tensor)]
    # one layer's chunk of a stacked tensor is what the converter holds; the stacked tensor is listed too
    per_layer = [t for k, t in model.state_dict().items() if k.startswith("decoder.layers.0.") and
                 isinstance(t, torch.Tensor)]
    return {"parameters": sum(t.numel() for t in tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "largest_tensor_bytes": max(t.numel() * t.element_size() for t in tensors),
            "largest_stacked_tensor_bytes": layers * max(t.numel() * t.element_size() for t in per_layer)}


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status (this benchmark needs Linux)")


def run_mode(mode: str, megatron_dir: str, ckpt: str, out: str) -> None:
    """Child process: convert once, print {'seconds', 'start_rss_bytes', 'peak_rss_bytes'} as JSON."""
    from meshtron.models.megatron.convert import megatron_to_meshtron, meshtron_to_megatron

    start_rss = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS: imports do not count
    start = time.perf_counter()
    if mode == "megatron-to-meshtron":
        megatron_to_meshtron(megatron_dir, ckpt)
    else:
        meshtron_to_megatron(ckpt, out)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "start_rss_bytes": start_rss, "peak_rss_bytes": _status_bytes("VmHWM")}))


def measure(mode: str, work: Path) -> dict:
    ckpt, out = work / "ckpt", work / "out"
    shutil.rmtree(ckpt if mode == "megatron-to-meshtron" else out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--child", mode, str(work / "megatron"), str(ckpt), str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        run_mode(*argv[1:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=12288)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="benchmarks/results/megatron_convert.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshtron-megatron-bench-") as tmp:
        work = Path(tmp)
        model = write_random_megatron(work / "megatron", args.hidden_size, args.layers, args.heads, args.ffn,
                                      args.vocab)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for mode in MODES:  # each megatron-to-meshtron run leaves the checkpoint the export reads
                runs[mode].append(measure(mode, work))
    summary = {mode: {"seconds": statistics.median(r["seconds"] for r in runs[mode]),
                      "start_rss_bytes": statistics.median(r["start_rss_bytes"] for r in runs[mode]),
                      "peak_rss_above_start_bytes": statistics.median(r["peak_rss_bytes"] - r["start_rss_bytes"]
                                                                      for r in runs[mode])}
               for mode in MODES}
    report = {"model": {**model, "hidden_size": args.hidden_size, "layers": args.layers, "ffn": args.ffn,
                        "heads": args.heads, "vocab": args.vocab}, "summary": summary, "runs": runs,
              "repeats": args.repeats, "python": platform.python_version(), "machine": platform.machine()}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    mib = 2**20
    print(f"model: {model['parameters'] / 1e6:.1f}M parameters, {model['bytes'] / mib:.0f} MiB fp32, largest tensor "
          f"{model['largest_tensor_bytes'] / mib:.1f} MiB, largest stacked Megatron tensor "
          f"{model['largest_stacked_tensor_bytes'] / mib:.1f} MiB ({args.repeats} runs each, medians)")
    print(f"{'mode':24s} {'seconds':>8s} {'RSS at start MiB':>17s} {'peak above start MiB':>21s} "
          f"{'x largest tensor':>17s} {'x model':>8s}")
    for mode, row in summary.items():
        above = row["peak_rss_above_start_bytes"]
        print(f"{mode:24s} {row['seconds']:8.2f} {row['start_rss_bytes'] / mib:17.0f} {above / mib:21.0f} "
              f"{above / model['largest_tensor_bytes']:17.1f} {above / model['bytes']:8.2f}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
