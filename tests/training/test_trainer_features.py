"""Trainer features against independent references: gradient clipping equals
torch.nn.utils.clip_grad_norm_, a bf16-autocast run stays close to fp32, the first step stays out of
the timer averages, and the logged MFU equals a closed-form FLOP count x tokens/s / peak."""

from __future__ import annotations

import json

import pytest
import torch

from meshtron.training import Trainer
from meshtron.training import timers as timers_module
from meshtron.training.timers import Timers

ONE_STEP = {"train.train_iters": "1", "checkpoint.save_at_end": "false", "optimizer.weight_decay": "0"}


def grads_before_optimizer_step(trainer: Trainer):
    """Run one train_step and return the gradients the optimizer sees (after clipping)."""
    seen: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def spy(*args, **kwargs):
        seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = spy
    result = trainer.train_step(trainer.loader.next_global_batch())
    assert not result.skipped and seen
    return seen, result


def test_clipping_equals_torch_clip_grad_norm(tiny_config):
    unclipped, raw = grads_before_optimizer_step(Trainer(tiny_config(**ONE_STEP, **{"optimizer.clip_grad": "0"})))
    max_norm = 0.05
    clipped, result = grads_before_optimizer_step(
        Trainer(tiny_config(**ONE_STEP, **{"optimizer.clip_grad": str(max_norm)})))
    reference = {n: g.clone() for n, g in unclipped.items()}
    params = []
    for g in reference.values():
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        params.append(p)
    total = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    assert total > 10 * max_norm  # clipping really rescales
    assert result.grad_norm == pytest.approx(total, rel=1e-6) and raw.grad_norm == pytest.approx(total, rel=1e-6)
    for name, p in zip(reference, params):
        torch.testing.assert_close(clipped[name], p.grad, rtol=1e-6, atol=1e-9, msg=name)
    clipped_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in clipped.values()]))
    assert float(clipped_norm) == pytest.approx(max_norm, rel=1e-4)


def test_bf16_autocast_run_is_close_to_fp32(tiny_config):
    common = {"train.train_iters": "3", "checkpoint.save_at_end": "false"}
    fp32 = Trainer(tiny_config(**common)).train()
    bf16 = Trainer(tiny_config(**common, **{"train.precision": "bf16"})).train()
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 0.2%); over 3 steps the loss (about 5.9 here)
    # stays within 1% of the fp32 run
    for a, b in zip(fp32, bf16):
        assert torch.isfinite(torch.tensor(b.loss))
        assert b.loss == pytest.approx(a.loss, rel=1e-2)
    assert [r.loss for r in bf16] != [r.loss for r in fp32]  # autocast was really on


def test_first_step_is_excluded_from_timer_averages(monkeypatch):
    clock = iter([0.0, 10.0,   # step 0: data 10 s (warm-up, excluded)
                  10.0, 11.0,  # step 1: data 1 s
                  11.0, 14.0,  # step 2: data 3 s
                  14.0, 14.5])  # step 2: optimizer 0.5 s
    monkeypatch.setattr(timers_module.time, "perf_counter", lambda: next(clock))
    timers = Timers()
    with timers.phase("data"):
        pass
    assert timers.end_step(0) == {"data": 10.0}
    with timers.phase("data"):
        pass
    timers.end_step(1)
    with timers.phase("data"):
        pass
    with timers.phase("optimizer"):
        pass
    assert timers.end_step(2) == {"data": 3.0, "optimizer": 0.5}
    assert timers.averages() == {"data": 2.0, "optimizer": 0.5}


def test_trainer_leaves_its_first_step_out_of_the_averages(tiny_config):
    trainer = Trainer(tiny_config(**{"train.train_iters": "3", "checkpoint.save_at_end": "false"}))
    trainer.train()
    assert dict(trainer.timers._step_counts) == {"data": 2, "forward_backward": 2, "optimizer": 2}


def closed_form_flops_per_token(d, heads, kv_heads, head_dim, ffn, layers, vocab, seq) -> float:
    """6 x matmul weights + 12 x layers x seq x heads x head_dim, for a dense SwiGLU GPT."""
    attention = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d
    mlp = 3 * d * ffn
    return 6.0 * (layers * (attention + mlp) + vocab * d) + 12.0 * layers * seq * heads * head_dim


def test_logged_mfu_is_flops_times_tokens_per_second_over_peak(tiny_config):
    cfg = tiny_config(**{"train.train_iters": "4", "logger.log_interval": "2", "checkpoint.save_at_end": "false"})
    Trainer(cfg).train()
    records = [json.loads(line) for line in open(f"{cfg.train.run_dir}/metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    # byte tokenizer: 256 bytes + specials, padded to a multiple of 128 -> 384
    flops = closed_form_flops_per_token(d=32, heads=4, kv_heads=2, head_dim=8, ffn=64, layers=2, vocab=384, seq=32)
    tokens_per_step = 4 * 32  # global batch x sequence length, every label in the loss
    for r in train:
        seconds = r["step_ms"] / 1e3 * 2  # the window of 2 steps
        assert r["tokens_per_s"] == pytest.approx(2 * tokens_per_step / seconds, rel=1e-9)
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_s"] / 1e11, rel=1e-9)
