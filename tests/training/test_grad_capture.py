"""Gradient capture: weight gradients equal a plain autograd reference, the output head's activation
gradient equals its closed form; captures of a TP2 run and the single process agree within the
expected bound k * C^(L+1-l) * eps, while a run with another seed does not; profiling writes a trace
of exactly the chosen steps with forward/backward/optimizer ranges."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from meshtron.data.loader import BatchLoader
from meshtron.models.gpt import GPTModel
from meshtron.nn.context import PackedContext
from meshtron.testing.multiprocess import run_ranks
from meshtron.training import Trainer
from meshtron.training.grad_capture import captured_steps, load_grads, read_meta
from meshtron.training.grad_compare import compare_grads, compare_runs, expected_bound, layer_index


def test_captured_gradients_equal_autograd_and_closed_form(tiny_config, tmp_path):
    cfg = tiny_config(**{"grads.save_wgrads": str(tmp_path / "w"), "grads.save_dgrads": str(tmp_path / "d"),
                         "train.train_iters": "1", "checkpoint.save_at_end": "false"})
    trainer = Trainer(cfg)
    reference = GPTModel(cfg.model, trainer.tokenizer.vocab_size)
    reference.load_state_dict(trainer.model.state_dict())   # the parameters step 1 starts from
    batch = BatchLoader(trainer.train_ds, micro_batch_size=2, global_batch_size=4,
                        seed=cfg.data.seed).next_global_batch()
    trainer.train()
    assert captured_steps(tmp_path / "w") == captured_steps(tmp_path / "d") == [1]
    assert read_meta(tmp_path / "w")["num_layers"] == 4

    total = sum(float(mb["loss_mask"].sum()) for mb in batch)
    head_grads = []
    for mb in batch:
        logits = reference(mb["input_ids"], PackedContext.for_tokens(mb["input_ids"]))
        logits.retain_grad()
        loss = (F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), reduction="none")
                * mb["loss_mask"].flatten()).sum() / total
        loss.backward()
        # closed form of d loss / d logits: (softmax - onehot) * mask / tokens
        expected = (logits.detach().softmax(-1) - F.one_hot(mb["labels"], logits.shape[-1])) * mb["loss_mask"][..., None]
        torch.testing.assert_close(logits.grad, expected / total)
        head_grads.append(logits.grad)
    wgrads = load_grads(tmp_path / "w", 1)
    names = {n for n, _ in reference.named_parameters() if n.endswith(("wq.weight", "w_up.weight", "output.weight"))}
    assert names <= set(wgrads) and "embedding.weight" in wgrads and "layers.0.norm.weight" not in wgrads
    for name, p in reference.named_parameters():
        if name in wgrads:
            torch.testing.assert_close(wgrads[name], p.grad, atol=1e-7, rtol=1e-5, msg=name)
    dgrads = load_grads(tmp_path / "d", 1)
    torch.testing.assert_close(dgrads["output.output"], torch.cat(head_grads), atol=1e-9, rtol=1e-5)
    # the head's own input gradient: d loss / d h = grad_logits @ W
    torch.testing.assert_close(dgrads["output.input"], torch.cat(head_grads) @ reference.output.weight.detach(),
                               atol=1e-9, rtol=1e-5)
    assert "embedding.output" in dgrads and "embedding.input" not in dgrads


def test_capture_interval(tiny_config, tmp_path):
    Trainer(tiny_config(**{"grads.save_wgrads": str(tmp_path / "w"), "grads.interval": "2",
                           "train.train_iters": "5", "checkpoint.save_at_end": "false"})).train()
    assert captured_steps(tmp_path / "w") == [2, 4]


def test_bound_grows_toward_the_input():
    assert layer_index("embedding.weight", 4) == 0 and layer_index("layers.2.mixer.wq.weight", 4) == 3
    assert layer_index("output.weight", 4) == 5
    assert expected_bound(0, 4) == pytest.approx(expected_bound(5, 4) * 1.1 ** 5)
    assert expected_bound(5, 4, "bf16") > 1e4 * expected_bound(5, 4, "fp32")


BASE = {
    "model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
    "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
    "data.seq_length": "32", "train.micro_batch_size": "2", "train.global_batch_size": "4",
    "train.train_iters": "2", "train.eval_interval": "0", "train.peak_flops": "1e11",
    "logger.progress_bar": "off", "scheduler.warmup_steps": "1", "checkpoint.save_at_end": "false",
}


def capture(rank: int, world_size: int, overrides: dict[str, str]) -> int:
    from meshtron.config.loader import load_config

    Trainer(load_config(overrides=overrides, world_size=world_size)).train()
    return rank


@pytest.mark.parametrize("layout", ["tp2_sp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_two_layouts_agree_within_the_expected_bound(layout, tmp_path):
    extra = {"tp2_sp": {"parallel.tp": "2"}, "fsdp2": {"parallel.dp_shard": "2"}}[layout]

    def dirs(name):
        return {"grads.save_wgrads": str(tmp_path / name / "w"), "grads.save_dgrads": str(tmp_path / name / "d"),
                "train.run_dir": str(tmp_path / name)}

    capture(0, 1, {**BASE, **dirs("single")})
    capture(0, 1, {**BASE, **dirs("other_seed"), "train.seed": "99"})
    run_ranks("tests.training.test_grad_capture:capture", 2, timeout_s=240,
              overrides={**BASE, **extra, **dirs("layout"), "parallel.timeout_s": "60"})
    for kind in ("w", "d"):
        same = compare_runs(tmp_path / "single" / kind, tmp_path / "layout" / kind)
        assert len(same) == len(load_grads(tmp_path / "single" / kind))
        worst = max(same, key=lambda d: d.rel_diff / d.bound)
        assert all(d.ok for d in same), (worst.name, worst.rel_diff, worst.bound)
        assert 0 < worst.rel_diff   # a different reduction order does change the bits
        other = compare_runs(tmp_path / "single" / kind, tmp_path / "other_seed" / kind)
        assert sum(not d.ok for d in other) >= 0.9 * len(other)
    a = load_grads(tmp_path / "single" / "w")
    assert not all(d.ok for d in compare_grads(a, {k: v * (1 + 1e-3) for k, v in a.items()}, 4))


def test_profile_records_exactly_the_chosen_steps(tiny_config, tmp_path):
    cfg = tiny_config(**{"profile.steps": "2:4", "train.train_iters": "5", "checkpoint.save_at_end": "false"})
    Trainer(cfg).train()
    trace = tmp_path / "run" / "profile" / "trace_rank0_steps2-3.json"
    assert trace.is_file() and (tmp_path / "run" / "profile" / "summary_rank0_steps2-3.txt").is_file()
    names = [e.get("name") for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
    # 2 micro-batches per step, 2 steps
    assert names.count("forward") == names.count("backward") == 4
    assert names.count("optimizer") == 2 and names.count("forward_backward") == 2


# no balancing loss, so the reference objective is the cross entropy alone
MOE = {"model.layer_pattern": "*E", "model.num_moe_experts": "4", "model.moe_router_topk": "2",
       "model.moe_aux_loss_coeff": "0"}


def test_moe_experts_and_router_are_captured(tiny_config, tmp_path):
    cfg = tiny_config(**MOE, **{"grads.save_wgrads": str(tmp_path / "w"), "grads.save_dgrads": str(tmp_path / "d"),
                                "train.train_iters": "1", "checkpoint.save_at_end": "false"})
    trainer = Trainer(cfg)
    reference = GPTModel(cfg.model, trainer.tokenizer.vocab_size)
    reference.load_state_dict(trainer.model.state_dict())
    batch = BatchLoader(trainer.train_ds, micro_batch_size=2, global_batch_size=4,
                        seed=cfg.data.seed).next_global_batch()
    trainer.train()

    experts = reference.layers[1].mixer.experts
    seen: dict[str, list[torch.Tensor]] = {"input": [], "output": []}

    def keep(module, args, output):   # the experts' input rows and output rows, gradients retained
        for key, t in (("input", args[0]), ("output", output)):
            t.retain_grad()
            seen[key].append(t)

    experts.register_forward_hook(keep)
    total = sum(float(mb["loss_mask"].sum()) for mb in batch)
    for mb in batch:
        logits = reference(mb["input_ids"], PackedContext.for_tokens(mb["input_ids"]))
        loss = (F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), reduction="none")
                * mb["loss_mask"].flatten()).sum() / total
        loss.backward()
    wgrads = load_grads(tmp_path / "w", 1)
    moe_names = {"layers.1.mixer.router.weight", "layers.1.mixer.experts.w_gate", "layers.1.mixer.experts.w_up",
                 "layers.1.mixer.experts.w_down"}
    assert moe_names <= set(wgrads)
    for name, p in reference.named_parameters():
        if name in wgrads:
            torch.testing.assert_close(wgrads[name], p.grad, atol=1e-7, rtol=1e-5, msg=name)
    dgrads = load_grads(tmp_path / "d", 1)
    for key in ("input", "output"):
        torch.testing.assert_close(dgrads[f"layers.1.mixer.experts.{key}"], torch.cat([t.grad for t in seen[key]]),
                                   atol=1e-9, rtol=1e-5)
    assert not any(k.startswith("layers.1.mixer.router.") for k in dgrads)


@pytest.mark.slow
def test_expert_parallel_capture_equals_single_process(tmp_path):
    def dirs(name):
        return {"grads.save_wgrads": str(tmp_path / name / "w"), "grads.save_dgrads": str(tmp_path / name / "d"),
                "train.run_dir": str(tmp_path / name), "train.train_iters": "1"}

    capture(0, 1, {**BASE, **MOE, **dirs("single")})
    run_ranks("tests.training.test_grad_capture:capture", 2, timeout_s=240,
              overrides={**BASE, **MOE, **dirs("ep2"), "parallel.dp_shard": "2", "parallel.ep": "2",
                         "parallel.timeout_s": "60"})
    single, ep = load_grads(tmp_path / "single" / "w"), load_grads(tmp_path / "ep2" / "w")
    assert set(single) == set(ep) and "layers.1.mixer.experts.w_down" in ep
    for name in single:
        assert ep[name].shape == single[name].shape, name   # all 4 experts, gathered over ep
        torch.testing.assert_close(ep[name], single[name], atol=1e-6, rtol=1e-5, msg=name)
    single, ep = load_grads(tmp_path / "single" / "d"), load_grads(tmp_path / "ep2" / "d")
    assert set(single) == set(ep)
    for name in single:
        if ".experts." in name:   # the same rows in another order (grouped by expert per rank)
            assert ep[name].shape == single[name].shape, name
            torch.testing.assert_close(ep[name].norm(dim=1).sort().values, single[name].norm(dim=1).sort().values,
                                       atol=1e-8, rtol=1e-4, msg=name)
            torch.testing.assert_close(ep[name].sum(0), single[name].sum(0), atol=1e-8, rtol=1e-4, msg=name)
        else:
            torch.testing.assert_close(ep[name], single[name], atol=1e-8, rtol=1e-4, msg=name)
