"""`make gpu-check`: one command that shows on a GPU what a CPU cannot, in a few minutes on one H100.

A list of independent checks, each small, each calling meshtron's public APIs (a `Trainer` from a
config, an `LLMEngine`, SDPA) and each catching its own exceptions, so one failing check never hides
the others. Each reports pass / fail / info (a measured number) / skip. The results go to a JSON file
and a table. Without CUDA it prints one line and exits 0; `--device cpu` runs the checks that mean
something on a CPU at tiny shapes (how the tests exercise every check's code).

    python -m meshtron.bench.gpu_check [--device cuda|cpu] [--only NAME,...] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

DEFAULT_OUTPUT = Path("benchmarks/results/gpu_check.json")
# 20 bf16 steps track fp32 within this relative loss difference
BF16_LOSS_RTOL = 0.02
NOTHING_TO_CHECK = "gpu-check: no CUDA device here; nothing to check (run it on a GPU machine)"


@dataclass
class Context:
    device: torch.device
    tiny: bool  # tiny shapes and few steps (a CPU run, the tests)
    workdir: Path


@dataclass
class Outcome:
    status: str  # pass, fail, info (a measurement), skip
    value: Any = None
    detail: str = ""


@dataclass
class Result:
    name: str
    status: str
    value: Any
    detail: str
    seconds: float = 0.0


def datasheet(device: torch.device) -> Optional[tuple[float, float]]:
    """(dense bf16 FLOP/s, HBM bytes/s) of the device from meshtron's datasheet table; None when
    unknown or a CPU."""
    from meshtron.training.flops import gpu_spec

    spec = gpu_spec(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return (spec.bf16_flops, spec.bandwidth_gbps * 1e9) if spec is not None else None


def needs_cuda(ctx: Context) -> Optional[Outcome]:
    return None if ctx.device.type == "cuda" else Outcome("skip", detail="needs CUDA")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- building blocks: a trainer from a config, a small engine ----------------------------------

TINY_MODEL = {"model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
              "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
              "data.seq_length": "32", "train.micro_batch_size": "2", "train.global_batch_size": "4"}
SMALL_MODEL = {"model.num_layers": "4", "model.hidden_size": "512", "model.num_attention_heads": "8",
               "model.num_query_groups": "null", "model.ffn_hidden_size": "2048",
               "model.max_position_embeddings": "512", "data.seq_length": "512", "train.micro_batch_size": "4",
               "train.global_batch_size": "8"}
GPT2_124M = {"model.layer_pattern": "", "model.num_layers": "12", "model.hidden_size": "768",
             "model.num_attention_heads": "12", "model.num_query_groups": "null", "model.kv_channels": "null",
             "model.ffn_hidden_size": "3072", "model.activation": "gelu", "model.vocab_size": "50304",
             "model.max_position_embeddings": "1024", "model.tie_word_embeddings": "true",
             "data.seq_length": "1024", "train.micro_batch_size": "16", "train.global_batch_size": "16"}


def build_trainer(ctx: Context, name: str, **overrides: str):
    from meshtron.config.loader import load_config
    from meshtron.training import Trainer

    values = {**(TINY_MODEL if ctx.tiny else SMALL_MODEL), "train.train_iters": "1000", "train.eval_interval": "0",
              "train.peak_flops": "1e12", "logger.progress_bar": "off", "checkpoint.save_at_end": "false",
              "train.device": ctx.device.type, "train.run_dir": str(ctx.workdir / name), **overrides}
    return Trainer(load_config(overrides=values), echo=False)


def train_losses(trainer, num_steps: int) -> list[float]:
    return [trainer.train_step(trainer.loader.next_global_batch()).loss for _ in range(num_steps)]


def build_engine(ctx: Context, dtype: torch.dtype = torch.float32, **options):
    from meshtron.config import ModelConfig
    from meshtron.data.tokenizer import ByteTokenizer
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.models import GPTModel

    tokenizer = ByteTokenizer()
    torch.manual_seed(0)
    layers, width = options.pop("num_layers", 8), options.pop("hidden_size", 1024)
    shape = (dict(num_layers=2, hidden_size=64, num_attention_heads=4) if ctx.tiny else
             dict(num_layers=layers, hidden_size=width, num_attention_heads=16))
    cfg = ModelConfig(max_position_embeddings=512, make_vocab_size_divisible_by=1, init_method_std=0.05, **shape)
    model = GPTModel(cfg, tokenizer.vocab_size).to(ctx.device, dtype).eval()
    return LLMEngine(model, tokenizer, EngineConfig(num_blocks=options.pop("num_blocks", 256), **options))


# ---- the checks ---------------------------------------------------------------------------------

def check_environment(ctx: Context) -> Outcome:
    import torch.distributed as dist

    info: dict[str, Any] = {"torch": torch.__version__, "device": str(ctx.device),
                            "nccl": dist.is_available() and dist.is_nccl_available()}
    if ctx.device.type != "cuda":
        return Outcome("info", info, "CPU: capability, bf16 and NCCL apply to CUDA")
    info.update(name=torch.cuda.get_device_name(ctx.device), capability=list(torch.cuda.get_device_capability(ctx.device)),
                bf16=torch.cuda.is_bf16_supported(), cuda=torch.version.cuda,
                sdpa_backends={"flash": torch.backends.cuda.flash_sdp_enabled(),
                               "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                               "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                               "math": torch.backends.cuda.math_sdp_enabled()})
    ok = info["capability"][0] >= 8 and info["bf16"] and info["nccl"]
    return Outcome("pass" if ok else "fail", info, "" if ok else "needs compute capability >= 8, bf16 and NCCL")


# (name, batch, heads, kv heads, queries, keys, mask kind) of the attention calls meshtron makes
ATTENTION_SHAPES = [("train causal", 4, 12, 12, 1024, 1024, "causal"),
                    ("train packed documents (bool mask)", 4, 12, 12, 1024, 1024, "mask"),
                    ("decode GQA, 1 query", 16, 32, 8, 1, 2048, "mask"),
                    ("prefill GQA causal", 1, 32, 8, 2048, 2048, "causal")]


def sdpa_kernel_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> str:
    """The SDPA implementation op that ran (flash, efficient, cudnn, math, CPU flash), by profiling."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    names = [e.name for e in prof.events() if e.name.startswith("aten::_") and "attention" in e.name]
    return names[0].removeprefix("aten::") if names else "unknown"


def check_sdpa_kernels(ctx: Context) -> Outcome:
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    kernels = {}
    for name, b, h, hkv, sq, sk, kind in ATTENTION_SHAPES:
        if ctx.tiny:
            b, sq, sk = 1, min(sq, 16), min(sk, 16)
        q = torch.randn(b, h, sq, 64, device=ctx.device, dtype=dtype)
        k, v = (torch.randn(b, hkv, sk, 64, device=ctx.device, dtype=dtype) for _ in range(2))
        kwargs: dict[str, Any] = {"enable_gqa": h != hkv}
        if kind == "causal":
            kwargs["is_causal"] = True
        else:
            kwargs["attn_mask"] = torch.ones(sq, sk, device=ctx.device, dtype=torch.bool).tril(sk - sq)
        kernels[name] = sdpa_kernel_name(q, k, v, **kwargs)
    if ctx.device.type != "cuda":
        return Outcome("info", kernels)
    fused = all("flash" in kernels[n] or "cudnn" in kernels[n] for n in ("train causal", "prefill GQA causal"))
    return Outcome("pass" if fused else "fail", kernels, "" if fused else "causal bf16 attention is not on flash/cudnn")


def count_syncs(fn: Callable[[], Any]) -> int:
    """Host syncs while `fn` runs, counted by CUDA's sync debug mode (one warning per sync)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_host_syncs(ctx: Context) -> Outcome:
    if (skip := needs_cuda(ctx)) is not None:
        return skip
    from meshtron.inference.request import SamplingParams

    trainer = build_trainer(ctx, "syncs", **{"train.global_batch_size": "16"})  # 4 micro-batches
    train_losses(trainer, 2)  # warm-up
    batch = trainer.loader.next_global_batch()
    train = count_syncs(lambda: trainer.train_step(batch))
    engine = build_engine(ctx, torch.bfloat16)
    for i in range(8):
        engine.add_request(list(range(1, 40 + i)), SamplingParams(max_tokens=64, temperature=0), req_id=f"r{i}")
    for _ in range(3):
        engine.step()
    step = count_syncs(engine.step)
    return Outcome("info", {"train_step": train, "engine_step": step}, "host syncs per step (4 micro-batches; "
                   "8 decodes)")


BF16_VARIANTS = {"eager": {}, "compile": {"parallel.compile": "true"},
                 "recompute": {"parallel.activation_checkpoint": "full"}}


def check_bf16_parity(ctx: Context, variants: Optional[tuple[str, ...]] = None) -> Outcome:
    """20 bf16 steps (compile off/on, recompute) track the fp32 losses of the same run."""
    steps = 3 if ctx.tiny else 20
    reference = train_losses(build_trainer(ctx, "fp32", **{"train.precision": "fp32"}), steps)
    worst = {}
    for name in variants or tuple(BF16_VARIANTS):
        losses = train_losses(build_trainer(ctx, f"bf16-{name}", **{"train.precision": "bf16"},
                                            **BF16_VARIANTS[name]), steps)
        worst[name] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    ok = all(v <= BF16_LOSS_RTOL for v in worst.values())
    return Outcome("pass" if ok else "fail", worst, f"max relative loss difference to fp32 over {steps} steps "
                   f"(limit {BF16_LOSS_RTOL})")


def check_throughput(ctx: Context) -> Outcome:
    """GPT-2-124M shape (12 x 768, seq 1024, batch 16): tokens/s and MFU against the datasheet peak."""
    trainer = build_trainer(ctx, "gpt2", **({} if ctx.tiny else GPT2_124M))
    warmup, steps = (1, 2) if ctx.tiny else (3, 10)
    train_losses(trainer, warmup)
    synchronize(ctx.device)
    start = time.perf_counter()
    train_losses(trainer, steps)
    synchronize(ctx.device)
    tokens_per_s = steps * trainer.cfg.train.global_batch_size * trainer.cfg.data.seq_length / (
        time.perf_counter() - start)
    peak = datasheet(ctx.device)
    mfu = trainer.flops_per_token * tokens_per_s / peak[0] if peak else None
    return Outcome("info", {"tokens_per_s": round(tokens_per_s, 1), "mfu": mfu and round(mfu, 4),
                            "precision": trainer.cfg.train.precision},
                   "MFU against the datasheet dense bf16 peak" if peak else "no datasheet peak for this device")


def check_checkpoint_resume(ctx: Context) -> Outcome:
    """Save after 2 steps, resume in a new trainer: its next 2 losses are the uninterrupted run's."""
    straight = train_losses(build_trainer(ctx, "straight"), 4)
    first = build_trainer(ctx, "resume")
    train_losses(first, 2)
    first.save()
    first.checkpoints.wait()
    resumed = build_trainer(ctx, "resume", **{"checkpoint.load": str(first.checkpoints.save_dir)})
    after = train_losses(resumed, 2)
    diff = max(abs(a - b) for a, b in zip(after, straight[2:]))
    tol = 0.0 if ctx.device.type == "cpu" else 1e-3 * abs(straight[-1])
    return Outcome("pass" if diff <= tol and resumed.step == 4 else "fail", {"max_loss_difference": diff},
                   f"resumed at step {resumed.step}")


def check_moe_grouped(ctx: Context) -> Outcome:
    """A MoE layer's grouped-GEMM experts against the per-expert loop: same output, and their times."""
    import copy

    from meshtron.config import ModelConfig
    from meshtron.nn.moe.layer import MoELayer

    hidden, experts, ffn, tokens = (32, 4, 64, 64) if ctx.tiny else (1024, 8, 2048, 8192)
    cfg = ModelConfig(hidden_size=hidden, num_attention_heads=1, num_moe_experts=experts, moe_router_topk=2,
                      moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn)
    cfg.validate()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    grouped = MoELayer(cfg)
    grouped.experts.init_weights(0.02, 0.02)
    looped = copy.deepcopy(grouped)
    looped.experts.grouped = False
    grouped, looped = (m.to(ctx.device, dtype).eval() for m in (grouped, looped))
    x = torch.randn(1, tokens, hidden, device=ctx.device, dtype=dtype)
    times = {}
    with torch.no_grad():
        outputs = {name: m(x) for name, m in (("grouped", grouped), ("looped", looped))}
        for name, m in (("grouped", grouped), ("looped", looped)):
            synchronize(ctx.device)
            start = time.perf_counter()
            for _ in range(3 if ctx.tiny else 20):
                m(x)
            synchronize(ctx.device)
            times[name] = time.perf_counter() - start
    diff = (outputs["grouped"].float() - outputs["looped"].float()).abs().max().item()
    scale = outputs["looped"].float().abs().max().item()
    ok = diff <= (2e-2 if dtype == torch.bfloat16 else 1e-5) * max(scale, 1e-6)
    return Outcome("pass" if ok else "fail", {"max_difference": diff, "speedup": times["looped"] / times["grouped"]},
                   "grouped vs looped experts, forward")


def peak_memory(ctx: Context, fn: Callable[[], Any]) -> Optional[int]:
    """Peak device bytes while `fn` runs (CUDA); None on a CPU."""
    if ctx.device.type != "cuda":
        fn()
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    fn()
    return torch.cuda.max_memory_allocated(ctx.device)


def check_offload(ctx: Context) -> Outcome:
    """Optimizer offload: host copies pinned (CUDA); resuming does not peak above a fresh start."""
    from meshtron.training.offload import OffloadOptimizer

    cuda, offload = ctx.device.type == "cuda", {"optimizer.offload_fraction": "1.0"}
    trainer = build_trainer(ctx, "offload", **offload)
    train_losses(trainer, 2)
    optimizer = trainer.optimizer
    assert isinstance(optimizer, OffloadOptimizer), "optimizer.offload_fraction 1.0 built no OffloadOptimizer"
    host = [t for h in optimizer.host.values() for t in (h.master, h.grad_buffer)]
    pinned, num_host = sum(t.is_pinned() for t in host), len(host)
    trainer.save()
    trainer.checkpoints.wait()
    saved = str(trainer.checkpoints.save_dir)
    del trainer, optimizer, host
    fresh = peak_memory(ctx, lambda: train_losses(build_trainer(ctx, "offload-fresh", **offload), 1))
    resumed = peak_memory(ctx, lambda: train_losses(
        build_trainer(ctx, "offload-resumed", **offload, **{"checkpoint.load": saved}), 1))
    value = {"host_tensors": num_host, "pinned": pinned}
    if not cuda:  # pinning needs an accelerator; the resume ran, its memory is not measured
        return Outcome("pass" if pinned == 0 and num_host > 0 else "fail", value, "CPU: nothing pinned, resume ran")
    value.update(peak_fresh_gib=fresh / 2**30, peak_resume_gib=resumed / 2**30)
    ok = pinned == num_host > 0 and resumed <= 1.1 * fresh
    return Outcome("pass" if ok else "fail", value, "all host copies pinned; resume peak within 10% of fresh")


def naive_attention(q, k, v, allowed: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """float64 masked softmax with a sink column per head: the reference for the flex checks."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~allowed, float("-inf"))
    sink = sinks.double().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    return torch.cat([logits, sink], -1).softmax(-1)[..., :-1] @ v


def check_flex_training(ctx: Context) -> Outcome:
    """Training attention through FlexAttention (packed documents, a sliding window, learnable sinks, GQA):
    the output and q's gradient against a float64 loop; `auto` must choose flex on CUDA. Forward only on a
    CPU (PyTorch 2.13 has no CPU backward for flex)."""
    from meshtron.nn.flex_attention import build_block_mask, flex_attend, use_flex

    cuda = ctx.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seq, heads, kv_heads, window = (64, 4, 2, 24) if ctx.tiny else (2048, 16, 4, 512)
    torch.manual_seed(0)
    q = torch.randn(1, heads, seq, 64, device=ctx.device, dtype=dtype, requires_grad=cuda)
    k, v = (torch.randn(1, kv_heads, seq, 64, device=ctx.device, dtype=dtype) for _ in range(2))
    sinks = torch.randn(heads, device=ctx.device)
    docs = (torch.arange(seq, device=ctx.device) * 3 // seq)[None]  # three packed documents
    positions = torch.arange(seq, device=ctx.device)[None]
    out = flex_attend(q, k, v, build_block_mask(positions, docs, window), scale=64 ** -0.5, sink_logits=sinks)
    i, j = positions[0][:, None], positions[0][None, :]
    allowed = (j <= i) & (i - j < window) & (docs[0][:, None] == docs[0][None, :])
    reference = naive_attention(q.detach(), k, v, allowed, sinks)
    value: dict[str, Any] = {"auto_picks_flex": use_flex("auto", q, masked=True, sinks=True, dropout=0.0),
                             "max_abs_err": (out.double() - reference).abs().max().item()}
    if cuda:
        out.float().square().sum().backward()
        q64 = q.detach().double().requires_grad_(True)
        naive_attention(q64, k, v, allowed, sinks).square().sum().backward()
        value["grad_rel_err"] = ((q.grad.double() - q64.grad).norm() / q64.grad.norm()).item()
    tol = 2e-2 if cuda else 1e-4
    ok = value["max_abs_err"] < tol and value.get("grad_rel_err", 0.0) < 2e-2 and value["auto_picks_flex"] == cuda
    return Outcome("pass" if ok else "fail", value, f"{str(dtype)[6:]}, documents + window + sinks + GQA")


def check_flex_paged(ctx: Context) -> Outcome:
    """The engine's decode attention: `auto` (FlexAttention over the paged cache on CUDA) gives the greedy
    tokens of `gather` (gather + SDPA) on the same weights."""
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    auto = build_engine(ctx, dtype) if ctx.device.type == "cuda" else build_engine(ctx, dtype, decode_attention="flex")
    gather = build_engine(ctx, dtype, decode_attention="gather")
    gather.runner.model.load_state_dict(auto.runner.model.state_dict())
    new = 8 if ctx.tiny else 32
    a, b = greedy(auto, PROMPTS, new), greedy(gather, PROMPTS, new)
    choice = auto.runner.decode_attention_choice
    ok = a == b and (choice == "flex")
    return Outcome("pass" if ok else "fail", {"choice": choice, "equal": a == b}, f"greedy, {new} tokens")


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from meshtron.inference.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [list(o.token_ids) for o in engine.generate(prompts, params)]


PROMPTS = [[1, 2, 3, 4], list(range(10, 40)), [7] * 9, list(range(100, 103))]


def check_cuda_graphs(ctx: Context) -> Outcome:
    """The engine with CUDA graphs gives the eager engine's greedy tokens (same bf16 weights)."""
    if (skip := needs_cuda(ctx)) is not None:
        return skip
    eager = build_engine(ctx, torch.bfloat16)
    graphed = build_engine(ctx, torch.bfloat16, cuda_graphs=True, max_num_seqs=8, max_num_batched_tokens=128,
                           cuda_graph_batch_sizes=(1, 2, 4, 8), cuda_graph_token_sizes=(64, 128))
    graphed.runner.model.load_state_dict(eager.runner.model.state_dict())
    a, b = greedy(eager, PROMPTS, 32), greedy(graphed, PROMPTS, 32)
    replays = graphed.runner.num_forwards["graph"]
    ok = a == b and replays > 0
    return Outcome("pass" if ok else "fail", {"graph_forwards": replays, "captured": len(graphed.runner.graphs.graphs),
                                              "equal": a == b}, "greedy tokens, graphs vs eager")


def check_decode_bandwidth(ctx: Context) -> Outcome:
    """Batch-1 decode: bytes read per token (weights + the keys/values so far) x tokens/s over HBM
    bandwidth (CUDA graphs on; a CPU reports tokens/s only)."""
    from meshtron.inference.runner import kv_bytes_per_token

    cuda = ctx.device.type == "cuda"
    engine = build_engine(ctx, torch.bfloat16 if cuda else torch.float32, num_layers=16, hidden_size=2048,
                          cuda_graphs=cuda, max_num_seqs=1, cuda_graph_batch_sizes=(1,), cuda_graph_token_sizes=(64,))
    model = engine.runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    greedy(engine, [[1, 2, 3]], 16)  # warm-up
    prompt, new = list(range(1, 33)), 16 if ctx.tiny else 256
    synchronize(ctx.device)
    start = time.perf_counter()
    greedy(engine, [prompt], new)
    seconds = time.perf_counter() - start
    mean_context = len(prompt) + new / 2
    bytes_per_token = weights + mean_context * kv_bytes_per_token(model)
    peak = datasheet(ctx.device)
    fraction = bytes_per_token * new / seconds / peak[1] if peak else None
    return Outcome("info", {"tokens_per_s": round(new / seconds, 1), "hbm_fraction": fraction and round(fraction, 3),
                            "weights_gib": weights / 2**30}, "includes the prefill step")


def check_engine_vs_transformers(ctx: Context) -> Outcome:
    """The engine's greedy tokens equal transformers' on the same (Llama) weights, bf16 on CUDA."""
    import transformers

    from meshtron.config import ModelConfig
    from meshtron.data.tokenizer import ByteTokenizer
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.models import GPTModel
    from meshtron.models.hf.init_weights import hf_model_config, load_hf_weights

    tokenizer = ByteTokenizer()
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    width, layers = (32, 2) if ctx.tiny else (512, 8)
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=width, intermediate_size=2 * width,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, initializer_range=0.2)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf_dir = ctx.workdir / "hf-llama"
    hf.save_pretrained(hf_dir)
    model = GPTModel(hf_model_config(hf_dir, ModelConfig()), tokenizer.vocab_size)
    load_hf_weights(model, hf_dir)
    engine = LLMEngine(model.to(ctx.device, dtype).eval(), tokenizer, EngineConfig(num_blocks=128))
    hf = hf.to(ctx.device, dtype)
    new = 8 if ctx.tiny else 16
    ours = greedy(engine, PROMPTS, new)
    theirs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device=ctx.device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0)
            theirs.append(out[0, len(prompt):].tolist())
    equal = sum(a == b for a, b in zip(ours, theirs))
    return Outcome("pass" if equal == len(PROMPTS) else "fail", {"equal_sequences": f"{equal}/{len(PROMPTS)}"},
                   f"greedy, {new} tokens, {str(dtype)[6:]}")


CHECKS: dict[str, Callable[[Context], Outcome]] = {
    "environment": check_environment, "sdpa_kernels": check_sdpa_kernels, "host_syncs": check_host_syncs,
    "bf16_parity": check_bf16_parity, "gpt2_throughput": check_throughput, "moe_grouped": check_moe_grouped,
    "offload": check_offload, "engine_vs_transformers": check_engine_vs_transformers,
    "cuda_graphs": check_cuda_graphs, "decode_bandwidth": check_decode_bandwidth,
    "checkpoint_resume": check_checkpoint_resume, "flex_training": check_flex_training, "flex_paged": check_flex_paged,
}


def run_check(name: str, check: Callable[[Context], Outcome], ctx: Context) -> Result:
    """One check; an exception is its failure (one line), never the others'."""
    start = time.perf_counter()
    try:
        out = check(ctx)
        result = Result(name, out.status, out.value, out.detail)
    except Exception as e:  # a check that crashes is a failed check, reported like the others
        lines = traceback.format_exception_only(type(e), e)
        result = Result(name, "fail", None, lines[-1].strip()[:300])
    result.seconds = round(time.perf_counter() - start, 2)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_checks(ctx: Context, names: Optional[list[str]] = None) -> list[Result]:
    unknown = sorted(set(names or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    return [run_check(n, CHECKS[n], ctx) for n in CHECKS if names is None or n in names]


def table(results: list[Result]) -> str:
    rows = [f"{'check':<24} {'status':<6} {'seconds':>8}  value / detail"]
    for r in results:
        value = json.dumps(r.value, default=str) if r.value is not None else ""
        rows.append(f"{r.name:<24} {r.status:<6} {r.seconds:>8.1f}  {value} {r.detail}".rstrip())
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m meshtron.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda when available, else print that there is nothing to check and exit 0")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(CHECKS)}")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON results (default {DEFAULT_OUTPUT})")
    args = parser.parse_args(argv)
    if args.device is None and not torch.cuda.is_available():
        print(NOTHING_TO_CHECK)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available; run without --device to skip")
    device = torch.device(args.device or "cuda")
    names = [n for n in args.only.split(",") if n] if args.only else None
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        try:
            results = run_checks(Context(device, device.type == "cpu", Path(tmp)), names)
        except ValueError as e:
            parser.error(str(e))
    print(table(results))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"device": str(device), "results": [asdict(r) for r in results]}, indent=1,
                                      default=str) + "\n")
    print(f"wrote {args.output}")
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
