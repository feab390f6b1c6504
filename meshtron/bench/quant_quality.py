"""What quantized weights cost in quality: for a checkpoint, each engine.quantize mode against the
fp32 model on held-out text (the test split of the checkpoint's own data config, documents training
never saw) and on greedy continuations through the engine.

Per mode: the mean and largest per-token |log p(quantized) - log p(fp32)| of the held-out next
tokens, the mean signed change (negative: the quantized model is less sure of the real text), the
perplexity of both, the share of held-out positions where both models rank the same token first
(teacher-forced top-1 agreement), and for greedy continuations of held-out prompts the share of
generated tokens equal to the fp32 engine's before the first difference, and the share of prompts
whose whole continuation is identical. Also the bytes of the linear layers' weights.

    python benchmarks/quant_quality.py --checkpoint runs/tiny/checkpoints [--modes int8-weight-only,int4-weight-only]
        [--windows 16] [--prompts 16] [--prompt-tokens 32] [--new-tokens 32] [--output FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_OUTPUT = Path("benchmarks/results/quant_quality.json")
DEFAULT_MODES = ("int8-weight-only", "int4-weight-only")


def held_out_windows(checkpoint: str, tokenizer, num_windows: int, max_len: int) -> torch.Tensor:
    """(windows, seq + 1) token ids from the test split of the data the checkpoint was trained on
    (data.seq_length, at most the model's max_len - 1, tokens of input plus the last label)."""
    import yaml

    from meshtron.checkpoint import read_checkpoint_config
    from meshtron.config.loader import config_from_dict
    from meshtron.data.build import build_datasets

    cfg = config_from_dict(yaml.safe_load(read_checkpoint_config(checkpoint)))
    cfg.data.seq_length = min(cfg.data.seq_length, max_len - 1)
    test = build_datasets(cfg, tokenizer)[2]
    if len(test) == 0:
        raise ValueError(f"--checkpoint: {checkpoint}'s data config has an empty test split; use a data.split with a "
                         "test share")
    rows = []
    for i in range(min(num_windows, len(test))):
        sample = test[i]
        rows.append(torch.cat([torch.as_tensor(sample["input_ids"][:1]), torch.as_tensor(sample["labels"])]))
    return torch.stack(rows).long()


@torch.no_grad()
def next_token_log_probs(model: torch.nn.Module, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (log p of each real next token (windows, seq), the top-1 token at each position (windows, seq))."""
    logits = model(windows[:, :-1]).float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return log_probs.gather(-1, windows[:, 1:, None]).squeeze(-1), logits.argmax(-1)


def greedy_continuations(model: torch.nn.Module, tokenizer, prompts: list[list[int]], new_tokens: int,
                         mode: str) -> list[list[int]]:
    """The engine's greedy tokens (quantizing `model` in place with `mode`)."""
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.inference.request import SamplingParams

    engine = LLMEngine(model, tokenizer, EngineConfig(quantize=mode, kv_cache_memory_mb=64, device="cpu"))
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return [list(out.token_ids) for out in engine.generate(prompts, params)]


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the linear layers' weights occupy, quantized tensors by their inner tensors (data + scales)."""
    total = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        w = module.weight
        if hasattr(w, "__tensor_flatten__") and type(w) is not torch.nn.Parameter:
            names, _ = w.__tensor_flatten__()
            inner = [getattr(w, n) for n in names]
            total += sum(t.numel() * t.element_size() for t in inner if isinstance(t, torch.Tensor))
        else:
            total += w.numel() * w.element_size()
    return total


def prefix_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(fp32_model: torch.nn.Module, tokenizer, windows: torch.Tensor, prompts: list[list[int]],
            new_tokens: int, modes: list[str]) -> dict[str, Any]:
    """The fp32 row and one row per mode (see the module docstring)."""
    ref_lp, ref_top = next_token_log_probs(fp32_model, windows)
    ref_text = greedy_continuations(copy.deepcopy(fp32_model), tokenizer, prompts, new_tokens, "none")
    rows = {"fp32": {"nll": float(-ref_lp.mean()), "perplexity": float(torch.exp(-ref_lp.mean())),
                     "linear_weight_mb": linear_weight_bytes(fp32_model) / 2**20}}
    for mode in modes:
        model = copy.deepcopy(fp32_model)
        t0 = time.perf_counter()
        texts = greedy_continuations(model, tokenizer, prompts, new_tokens, mode)   # quantizes `model`
        lp, top = next_token_log_probs(model, windows)
        delta = lp - ref_lp
        agreed = [prefix_agreement(a, b) for a, b in zip(texts, ref_text)]
        rows[mode] = {
            "nll": float(-lp.mean()), "perplexity": float(torch.exp(-lp.mean())),
            "mean_abs_logprob_delta": float(delta.abs().mean()), "max_abs_logprob_delta": float(delta.abs().max()),
            "mean_logprob_delta": float(delta.mean()), "top1_agreement": float((top == ref_top).float().mean()),
            "greedy_prefix_agreement": sum(agreed) / (len(prompts) * new_tokens),
            "greedy_identical": sum(n == new_tokens for n in agreed) / len(prompts),
            "linear_weight_mb": linear_weight_bytes(model) / 2**20, "seconds": time.perf_counter() - t0,
        }
    return rows


def run(checkpoint: str, modes: list[str], num_windows: int, num_prompts: int, prompt_tokens: int,
        new_tokens: int) -> dict[str, Any]:
    from meshtron.inference.loading import load_model_and_tokenizer

    model, tokenizer, name = load_model_and_tokenizer(checkpoint, "cpu")
    max_len = model.cfg.max_position_embeddings
    if prompt_tokens + new_tokens > max_len:
        raise ValueError(f"--prompt-tokens + --new-tokens: {prompt_tokens + new_tokens} exceeds the model's "
                         f"max_position_embeddings {max_len}; lower them")
    windows = held_out_windows(checkpoint, tokenizer, max(num_windows, num_prompts), max_len)
    prompts = [row[:prompt_tokens].tolist() for row in windows[:num_prompts]]
    rows = compare(model, tokenizer, windows[:num_windows], prompts, new_tokens, modes)
    return {"checkpoint": checkpoint, "model": name, "parameters": sum(p.numel() for p in model.parameters()),
            "held_out_tokens": int(windows[:num_windows, 1:].numel()), "prompts": len(prompts),
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "torch": torch.__version__,
            "torchao": _torchao_version(), "machine": platform.processor() or platform.machine(), "rows": rows}


def _torchao_version() -> str:
    from meshtron.nn.torchao import import_torchao

    return import_torchao().__version__


def format_table(result: dict[str, Any]) -> str:
    head = (f"{'mode':<20} {'weights MB':>10} {'ppl':>8} {'mean|dlogp|':>11} {'max|dlogp|':>10} {'mean dlogp':>10} "
            f"{'top1 agree':>10} {'greedy prefix':>13} {'identical':>9}")
    lines = [f"{result['model']}: {result['parameters'] / 1e6:.2f}M parameters, {result['held_out_tokens']} held-out "
             f"tokens, {result['prompts']} greedy continuations of {result['new_tokens']} tokens", head]
    for mode, r in result["rows"].items():
        if mode == "fp32":
            lines.append(f"{mode:<20} {r['linear_weight_mb']:>10.2f} {r['perplexity']:>8.3f}")
            continue
        lines.append(f"{mode:<20} {r['linear_weight_mb']:>10.2f} {r['perplexity']:>8.3f} "
                     f"{r['mean_abs_logprob_delta']:>11.4f} {r['max_abs_logprob_delta']:>10.4f} "
                     f"{r['mean_logprob_delta']:>10.4f} {r['top1_agreement']:>10.1%} "
                     f"{r['greedy_prefix_agreement']:>13.1%} {r['greedy_identical']:>9.1%}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from meshtron.config.loader import OneLineParser

    p = OneLineParser(prog="quant_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a trained checkpoint (a step dir or its parent with 'latest')")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated engine.quantize modes (default {','.join(DEFAULT_MODES)})")
    p.add_argument("--windows", type=int, default=16, help="held-out windows of data.seq_length tokens (default 16)")
    p.add_argument("--prompts", type=int, default=16, help="greedy continuations compared (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each held-out prompt (default 32)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help=f"JSON written here (default {DEFAULT_OUTPUT})")
    return p


def main(argv: list[str] | None = None) -> int:
    from meshtron.inference.config import EngineConfig

    args = build_parser().parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in EngineConfig.QUANTIZE_MODES or m == "none"]
    if bad:
        print(f"--modes: {bad[0]!r} is not a quantized mode; choose from "
              f"{', '.join(EngineConfig.QUANTIZE_MODES[1:])}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    result = run(args.checkpoint, modes, args.windows, args.prompts, args.prompt_tokens, args.new_tokens)
    print(format_table(result))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
