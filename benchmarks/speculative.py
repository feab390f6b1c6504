"""Speculative decoding with a trained MTP head: batch-1 greedy tokens/s with and without it.

Two steps (docs/benchmarks.md has the commands and the numbers):
  train-head  add one MTP depth (DeepSeek-V3 style) to a trained checkpoint and train only the depth on
              the embedded stdlib tokens (the trunk and the shared embedding/head frozen), for a time
              budget; writes a model-only checkpoint whose config has model.mtp_num_layers 1
              (configs/tiny-mtp.yaml trains trunk and depth together from scratch instead);
  measure     greedy decode of held-out prompts through the engine (LLMEngine.from_checkpoint), plain
              and with engine.speculative_method mtp for each k; tokens/s, acceptance rate, tokens per
              forward, and whether the speculative tokens equal the plain ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml


def train_head(args) -> None:
    from meshtron.checkpoint import read_checkpoint_config
    from meshtron.inference.loading import load_model_and_tokenizer
    from meshtron.models import GPTModel
    from meshtron.models.hf.dcp_io import write_model_checkpoint

    torch.manual_seed(args.seed)
    base, tokenizer, _ = load_model_and_tokenizer(args.checkpoint, "cpu")
    model = GPTModel(dataclasses.replace(base.cfg, mtp_num_layers=1), tokenizer.vocab_size)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("mtp.") for k in missing), (missing, unexpected)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    tokens = np.memmap(args.data, dtype=np.uint16, mode="r")
    train_end = int(len(tokens) * 0.97)  # the last 3% stay held out for `measure`
    g = np.random.default_rng(args.seed)
    optimizer = torch.optim.AdamW(model.mtp.parameters(), lr=args.lr, weight_decay=0.0)
    start, step = time.monotonic(), 0
    while time.monotonic() - start < args.minutes * 60:
        at = g.integers(0, train_end - args.seq_length - 2, args.batch_size)
        batch = torch.from_numpy(np.stack([tokens[a:a + args.seq_length + 2] for a in at]).astype(np.int64))
        _, (depth_logits,) = model(batch[:, :args.seq_length], return_mtp=True)
        # depth 1 at position i predicts token i + 2
        loss = F.cross_entropy(depth_logits.flatten(0, 1).float(), batch[:, 2:args.seq_length + 2].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 20 == 0:
            print(f"step {step} | mtp loss {loss.item():.3f} | {time.monotonic() - start:.0f}s", flush=True)
    run_cfg = yaml.safe_load(read_checkpoint_config(args.checkpoint))
    run_cfg["model"]["mtp_num_layers"] = 1
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    out = write_model_checkpoint(args.output, step, {k: (tuple(v.shape), torch.float32) for k, v in state.items()},
                                 state.__getitem__, {"step": step, "model_only": True, "source": str(args.checkpoint)},
                                 yaml.safe_dump(run_cfg, sort_keys=False))
    print(f"trained the MTP depth for {step} steps ({args.minutes} min); checkpoint {out}")


def measure(args) -> None:
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.inference.request import SamplingParams

    tokens = np.memmap(args.data, dtype=np.uint16, mode="r")
    g = np.random.default_rng(args.seed)
    held_out = int(len(tokens) * 0.97)
    starts = g.integers(held_out, len(tokens) - args.prompt_len, args.num_prompts)
    prompts = [tokens[s:s + args.prompt_len].astype(np.int64).tolist() for s in starts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows, plain_ids = [], None
    for k in [0, *args.k]:
        options = dict(speculative_method="mtp", num_speculative_tokens=k) if k else {}
        engine = LLMEngine.from_checkpoint(args.checkpoint, EngineConfig(num_blocks=256, **options))
        engine.generate([prompts[0]], [params])  # warm-up (native kernel build, allocator)
        best, ids = float("inf"), []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ids = [engine.generate([p], [params])[0].token_ids for p in prompts]  # batch 1, one after another
            best = min(best, time.perf_counter() - t0)
        spec = engine.stats().get("speculative", {})
        num_tokens = sum(len(x) for x in ids)
        plain_ids = ids if k == 0 else plain_ids
        rows.append((k, num_tokens / best, spec.get("acceptance_rate"), spec.get("tokens_per_verify"),
                     ids == plain_ids))
    base = rows[0][1]
    print(f"{'k':>3} {'tokens/s':>9} {'speed-up':>8} {'acceptance':>10} {'tok/verify':>10} {'same tokens':>11}")
    for k, tps, acc, per, same in rows:
        print(f"{k or 'off':>3} {tps:9.1f} {tps / base:7.2f}x {'-' if acc is None else f'{acc:.1%}':>10} "
              f"{'-' if per is None else f'{per:.2f}':>10} {str(same):>11}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train-head", help="add one MTP depth to a checkpoint and train only it")
    t.add_argument("--checkpoint", required=True, help="a trained checkpoint (e.g. runs/tiny/checkpoints)")
    t.add_argument("--output", required=True, help="directory of the new checkpoint")
    t.add_argument("--data", default="runs/data/stdlib.bin", help="the token file of the dataset (uint16)")
    t.add_argument("--minutes", type=float, default=5.0)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seq-length", type=int, default=128)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("measure", help="batch-1 greedy tokens/s, plain and speculative (mtp)")
    m.add_argument("--checkpoint", required=True, help="a checkpoint with model.mtp_num_layers >= 1")
    m.add_argument("--data", default="runs/data/stdlib.bin")
    m.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="num_speculative_tokens to measure")
    m.add_argument("--num-prompts", type=int, default=8)
    m.add_argument("--prompt-len", type=int, default=32)
    m.add_argument("--max-tokens", type=int, default=96)
    m.add_argument("--repeats", type=int, default=2)
    m.add_argument("--seed", type=int, default=0)
    for sub_parser in (t, m):
        sub_parser.add_argument("--threads", type=int, default=None,
                                help="torch intra-op threads (default: torch's); 1 avoids multi-threaded GEMMs "
                                     "of the k + 1 token forwards stalling on a machine shared by other jobs")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    Path(getattr(args, "output", ".") or ".").parent.mkdir(parents=True, exist_ok=True)
    {"train-head": train_head, "measure": measure}[args.command](args)


if __name__ == "__main__":
    main()
