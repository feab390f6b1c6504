"""Training an MoE model: the aux losses join the objective with the documented weight, are logged with
per-layer load and dropped fractions, expert biases follow the observed load, and a router registered
from this module, or declared as an entry point by an installed package, is used end to end."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from meshtron.nn.context import PackedContext
from meshtron.nn.loss import masked_cross_entropy
from meshtron.nn.moe import MoELayer, register_router
from meshtron.training import Trainer

MOE = {"model.num_moe_experts": "4", "model.moe_router_topk": "2", "model.moe_z_loss_coeff": "0.01",
       "model.moe_aux_loss_coeff": "0.1", "model.moe_layer_freq": "[0, 1]"}
SGD = {"optimizer.type": "sgd", "optimizer.lr": "0.5", "optimizer.weight_decay": "0", "optimizer.clip_grad": "0",
       "scheduler.warmup_steps": "0", "scheduler.decay_style": "constant", "train.train_iters": "1",
       "checkpoint.save_at_end": "false"}


def reference_gradients(model, micro_batches):
    """Gradient of sum_mb [CE sum_mb / tokens + sum_layers aux_layer,mb / num_mb], written out."""
    model = copy.deepcopy(model)
    inputs = []
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.aux_loss_scale = 0.0  # the aux term is added explicitly below
            layer.register_forward_pre_hook(lambda m, args: inputs.append((m, args[0])))
    total = sum(float(mb["loss_mask"].sum()) for mb in micro_batches)
    for mb in micro_batches:
        inputs.clear()
        logits = model(mb["input_ids"], PackedContext.for_tokens(mb["input_ids"]))
        ce, _ = masked_cross_entropy(logits, mb["labels"], mb["loss_mask"])
        aux = sum(m.router(x)[2] for m, x in inputs)
        (ce / total + aux / len(micro_batches)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_aux_losses_enter_the_objective_with_the_documented_weight(tiny_config):
    trainer = Trainer(tiny_config(**MOE, **SGD))
    assert trainer.cfg.model.pattern == "*-*E"
    batch = trainer.loader.next_global_batch()
    expected = reference_gradients(trainer.model, batch)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train_step(batch)
    for name, p in trainer.model.named_parameters():
        grad = (before[name] - p.detach()) / 0.5
        torch.testing.assert_close(grad, expected[name], atol=2e-6, rtol=1e-4, msg=name)
    assert expected["layers.3.mixer.router.weight"].abs().sum() > 0
    assert result.extra["moe_aux_loss"] > 0 and result.extra["moe_z_loss"] > 0


def test_moe_metrics_logged_and_expert_bias_updated(tiny_config):
    cfg = tiny_config(**{**MOE, "model.moe_router_enable_expert_bias": "true", "model.moe_aux_loss_coeff": "0",
                         "model.moe_expert_capacity_factor": "1.0", "train.train_iters": "2",
                         "checkpoint.save_at_end": "false"})
    trainer = Trainer(cfg)
    history = trainer.train()
    bias = trainer.model.layers[3].mixer.router.expert_bias
    # two updates of +-rate each: every entry is a multiple of the rate in [-2 rate, 2 rate]
    steps = bias / cfg.model.moe_router_bias_update_rate
    torch.testing.assert_close(steps, steps.round(), atol=1e-4, rtol=0)
    assert steps.abs().max() > 0 and steps.abs().max() <= 2 + 1e-4
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    moe = [r for r in records if r["kind"] == "moe"]
    assert {"moe_load_max", "moe_dropped_frac"} <= set(train[-1]) and "moe_aux_loss" not in train[-1]
    assert len(moe) == 2 and abs(sum(moe[-1]["moe_load_L3"]) - 1.0) < 1e-3
    assert 0.0 <= moe[-1]["moe_dropped_L3"] < 1.0 and history[-1].extra["moe_dropped_frac"] >= 0.0


@register_router("test_sticky_top1")
class StickyTop1Router(nn.Module):
    """A user's router from outside meshtron: top-1 of a linear score, weight = its sigmoid, and an
    L2 penalty on the scores as its aux loss."""

    def __init__(self, cfg):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_moe_experts, bias=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        scores = self.proj(x.reshape(-1, x.shape[-1]))
        indices = scores.argmax(-1, keepdim=True)
        return torch.sigmoid(scores.gather(1, indices)), indices, 0.5 * scores.square().mean()


def test_custom_router_registered_from_a_test_module_trains_end_to_end(tiny_config):
    cfg = tiny_config(**{**MOE, **SGD, "model.moe_router_type": "test_sticky_top1", "model.moe_router_topk": "1"})
    trainer = Trainer(cfg)
    router = trainer.model.layers[3].mixer.router
    assert isinstance(router, StickyTop1Router)
    batch = trainer.loader.next_global_batch()
    expected = reference_gradients(trainer.model, batch)
    before = router.proj.weight.detach().clone()
    result = trainer.train_step(batch)
    assert router.calls == len(batch)  # one call per micro-batch (the reference ran a copy)
    torch.testing.assert_close((before - router.proj.weight.detach()) / 0.5,
                               expected["layers.3.mixer.router.proj.weight"], atol=2e-6, rtol=1e-4)
    assert result.extra["moe_aux_loss"] > 0


PLUGIN = '''
import torch
from torch import nn


class AllToExpertZero(nn.Module):
    """Every token to expert 0 with weight 1, no aux loss."""

    def __init__(self, cfg):
        super().__init__()

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1]).shape[0]
        return x.new_ones(tokens, 1), torch.zeros(tokens, 1, dtype=torch.long, device=x.device), x.new_zeros(())
'''


def write_router_plugin(root):
    """An installed-looking distribution under `root`: a package and its dist-info with an entry point
    `all_to_zero` in group meshtron.routers (what `pip install` of a package declaring it leaves)."""
    (root / "zero_router_plugin").mkdir(parents=True)
    (root / "zero_router_plugin" / "__init__.py").write_text(PLUGIN)
    info = root / "zero_router_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zero-router-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[meshtron.routers]\nall_to_zero = zero_router_plugin:AllToExpertZero\n")


def test_router_from_an_entry_point_is_used_by_meshtron_train(tmp_path):
    """`meshtron train` (a fresh process, no script importing the plugin) builds the router an installed
    package declares; the logged per-layer load shows every token on expert 0."""
    import os
    import subprocess
    import sys

    from tests.conftest import TINY

    write_router_plugin(tmp_path / "site")
    flags = {**TINY, **MOE, "model.moe_router_type": "all_to_zero", "model.moe_router_topk": "1",
             "train.train_iters": "2", "train.run_dir": str(tmp_path / "run"), "checkpoint.save_at_end": "false"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.getcwd()]),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "meshtron", "train", *[f"--{k}={v}" for k, v in flags.items()]],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    moe = [r for r in records if r["kind"] == "moe"]
    assert moe and all(r["moe_load_L3"] == [1.0, 0.0, 0.0, 0.0] for r in moe)
    # the same config with the built-in router spreads the load (in process: cheaper)
    from meshtron.config import load_config

    flags.update({"model.moe_router_type": "topk", "train.run_dir": str(tmp_path / "run2")})
    Trainer(load_config(overrides=flags), echo=False).train()
    records = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["moe_load_L3"][0] < 1.0 for r in records if r["kind"] == "moe")


def test_unknown_router_error_lists_built_in_and_entry_point_names(tmp_path, monkeypatch, capsys):
    from meshtron.cli import main

    write_router_plugin(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    capsys.readouterr()
    assert main(["train", "--model.num_moe_experts=4", "--model.moe_router_type=nope",
                 f"--train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.moe_router_type: 'nope' is not allowed"), err
    assert "topk" in err[0] and "all_to_zero" in err[0] and "meshtron.routers" in err[0]


def test_broken_entry_point_is_one_config_line(tmp_path, monkeypatch):
    from meshtron.config.fields import ConfigError
    from meshtron.nn.moe.router import router_class

    write_router_plugin(tmp_path / "site")
    (tmp_path / "site" / "zero_router_plugin-0.1.dist-info" / "entry_points.txt").write_text(
        "[meshtron.routers]\nnot_a_module = zero_router_plugin:Missing\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ConfigError, match=r"model.moe_router_type: entry point not_a_module = zero_router_plugin:Missing"):
        router_class("not_a_module")
