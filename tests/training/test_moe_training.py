"""Training an MoE model: the aux losses join the objective with the documented weight, are logged with
per-layer load and dropped fractions, expert biases follow the observed load, and a router registered
from this module is used end to end."""

from __future__ import annotations

import copy
import json

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
