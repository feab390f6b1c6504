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
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks.convert import add_shape_arguments, run_child, timed_conversion  # noqa: E402

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


def run_mode(mode: str, megatron_dir: str, ckpt: str, out: str) -> None:
    from meshtron.models.megatron.convert import megatron_to_meshtron, meshtron_to_megatron

    if mode == "megatron-to-meshtron":
        timed_conversion(lambda: megatron_to_meshtron(megatron_dir, ckpt))
    else:
        timed_conversion(lambda: meshtron_to_megatron(ckpt, out))


def measure(mode: str, work: Path) -> dict:
    ckpt, out = work / "ckpt", work / "out"
    shutil.rmtree(ckpt if mode == "megatron-to-meshtron" else out, ignore_errors=True)
    return run_child(__file__, mode, work / "megatron", ckpt, out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        run_mode(*argv[1:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser, "benchmarks/results/megatron_convert.json")
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
