"""MoE router, routing map, experts and sublayer against per-token Python loops (tests/nn/moe_reference.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from meshtron.config.schema import ModelConfig
from meshtron.nn.moe import GroupedExperts, MoELayer, end_of_step
from meshtron.nn.moe.routing_map import build_routing_map
from tests.nn import moe_reference as ref

BASE = dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=8,
            moe_router_topk=2, vocab_size=64, moe_aux_loss_coeff=0.1)

ROUTERS = {
    "softmax_topk_then_softmax": dict(),
    "softmax_then_topk": dict(moe_router_pre_softmax=True),
    "softmax_seq_aux_z": dict(moe_router_load_balancing_type="seq_aux_loss", moe_z_loss_coeff=0.01),
    "sigmoid_scaled": dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5),
    "sigmoid_groups_bias": dict(moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
                                moe_router_enable_expert_bias=True, moe_router_topk=4,
                                moe_router_load_balancing_type="seq_aux_loss"),
    "softmax_groups_top1": dict(moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk=1),
    "router_bias": dict(moe_router_add_bias=True, moe_router_load_balancing_type="none"),
}


def make_cfg(**kw) -> ModelConfig:
    cfg = ModelConfig(**{**BASE, **kw})
    cfg.validate()
    return cfg


def make_layer(cfg: ModelConfig, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(cfg)
    layer.experts.init_weights(0.2, 0.2)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        if layer.router.bias is not None:
            layer.router.bias.normal_(0.0, 0.5)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(torch.randn(cfg.num_moe_experts) * 0.05)
        for b in (layer.experts.b_gate, layer.experts.b_up, layer.experts.b_down):
            if b is not None:
                b.normal_(0.0, 0.1)
    return layer


@pytest.mark.parametrize("variant", sorted(ROUTERS))
def test_router_matches_per_token_loop(variant):
    cfg = make_cfg(**ROUTERS[variant])
    layer = make_layer(cfg)
    x = torch.randn(3, 5, cfg.hidden_size)
    probs, indices, aux = layer.router(x)
    tokens = x.reshape(-1, cfg.hidden_size).double()
    bias = None if layer.router.bias is None else layer.router.bias.double()
    logits = torch.nn.functional.linear(tokens, layer.router.weight.double(), bias)
    for t in range(tokens.shape[0]):
        chosen, weights = ref.route_token(logits[t], cfg, layer.router.expert_bias)
        got = dict(zip(indices[t].tolist(), probs[t].tolist()))
        assert sorted(got) == sorted(chosen), f"token {t}"
        for e, w in zip(chosen, weights):
            assert got[e] == pytest.approx(w, abs=1e-6)
    expected = 0.0
    if cfg.moe_router_load_balancing_type != "none":
        expected += ref.balancing_loss(logits, cfg, seq_len=5)
    if cfg.moe_z_loss_coeff:
        expected += ref.z_loss(logits, cfg.moe_z_loss_coeff)
    assert float(aux) == pytest.approx(expected, rel=1e-5, abs=1e-8)


# routers whose picks differ from the plain top-k (expert bias, groups, replay) and plain ones
BALANCED = {
    "softmax_aux": dict(),
    "softmax_pre_seq_aux": dict(moe_router_pre_softmax=True, moe_router_load_balancing_type="seq_aux_loss"),
    "sigmoid_bias_aux": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "sigmoid_groups_bias_seq_aux": ROUTERS["sigmoid_groups_bias"],
    "softmax_groups_aux": dict(moe_router_num_groups=4, moe_router_group_topk=1),
}


def biased_layer(cfg: ModelConfig) -> MoELayer:
    """A layer whose expert bias (when it has one) is large enough to change most tokens' picks."""
    layer = make_layer(cfg)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, cfg.num_moe_experts))
    return layer


@pytest.mark.parametrize("variant", sorted(BALANCED))
def test_balancing_loss_matches_megatron_core(variant):
    """The aux / seq-aux loss against megatron-core's own functions on the same logits:
    compute_routing_scores_for_aux_loss (plain top-k of the unbiased scores) and
    switch_load_balancing_loss_func, the sequence-level loss computed as Megatron's router does it
    (sequence-major tokens, the batch folded into the expert dim, divided by the batch size)."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    cfg = make_cfg(**BALANCED[variant])
    layer = biased_layer(cfg)
    batch, seq, E, k = 3, 6, cfg.num_moe_experts, cfg.moe_router_topk
    x = torch.randn(batch, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    _, indices, aux = layer.router(x)
    with torch.no_grad():
        logits = layer.router.logits(x.reshape(-1, cfg.hidden_size)).view(batch, seq, E)
    plain = logits.reshape(-1, E).topk(k, dim=-1).indices
    if cfg.moe_router_enable_expert_bias or cfg.moe_router_num_groups:  # the case the loss must not follow
        assert not torch.equal(indices.sort(-1).values, plain.sort(-1).values)
    megatron_logits = logits.transpose(0, 1).reshape(-1, E)  # Megatron orders tokens (seq, batch)
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(megatron_logits, k,
                                                                        cfg.moe_router_score_function)
    coeff = cfg.moe_aux_loss_coeff
    if cfg.moe_router_load_balancing_type == "aux_loss":
        expected = moe_utils.switch_load_balancing_loss_func(scores, routing_map.sum(0), batch * seq, k, E, coeff)
    else:
        per_seq_map = routing_map.reshape(seq, -1)
        expected = moe_utils.switch_load_balancing_loss_func(scores.reshape(seq, -1), per_seq_map.sum(0), seq, k, E,
                                                             coeff) / batch
    assert float(aux) == pytest.approx(float(expected), rel=1e-6)
    assert float(aux) == pytest.approx(ref.balancing_loss(logits.reshape(-1, E).double(), cfg, seq_len=seq), rel=1e-5)


def test_balancing_loss_ignores_the_expert_bias_by_hand():
    """Two experts, top-1, two tokens both preferring expert 0; a bias of +1 on expert 1 sends both there.
    DeepSeek-V3 eq. 17-18: f = (1, 0) from the unbiased picks, so the loss is 2 * P_0, not 2 * P_1."""
    cfg = make_cfg(num_moe_experts=2, moe_router_topk=1, moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True, moe_aux_loss_coeff=1.0)
    layer = make_layer(cfg)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 1] = 2.0, -1.0
        layer.router.expert_bias.copy_(torch.tensor([0.0, 1.0]))
    x = torch.zeros(1, 2, cfg.hidden_size)
    x[0, 0, 0], x[0, 0, 1], x[0, 1, 0] = 1.0, 1.0, 0.5  # logits (2, -1) and (1, 0)
    _, indices, aux = layer.router(x)
    assert indices.flatten().tolist() == [1, 1]
    s = [torch.sigmoid(torch.tensor(v, dtype=torch.float64)) for v in ((2.0, -1.0), (1.0, 0.0))]
    p0 = sum(float(v[0] / v.sum()) for v in s) / 2
    assert float(aux) == pytest.approx(2 * p0, rel=1e-6)


@pytest.mark.parametrize("variant", ["swiglu", "gptoss_glu_bias", "squared_relu_shared", "shared_gate"])
@pytest.mark.parametrize("grouped", [True, False])
def test_layer_matches_per_token_loop(variant, grouped):
    kw = {"swiglu": {},
          "gptoss_glu_bias": dict(activation="quick_geglu", activation_func_clamp_value=0.3, glu_linear_offset=1.0,
                                  add_bias_linear=True, moe_router_add_bias=True),
          "squared_relu_shared": dict(activation="squared_relu", moe_shared_expert_intermediate_size=24),
          "shared_gate": dict(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True,
                              moe_router_score_function="sigmoid")}[variant]
    cfg = make_cfg(moe_grouped_gemm=grouped, **kw)
    layer = make_layer(cfg)
    x = torch.randn(2, 6, cfg.hidden_size)
    expected = ref.moe_layer_reference(layer, x, cfg)
    torch.testing.assert_close(layer(x).double(), expected, atol=2e-6, rtol=1e-5)


def test_grouped_and_looped_experts_agree_forward_and_backward():
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 32, "swiglu", bias=True)
    experts.init_weights(0.2, 0.2)
    x = torch.randn(11, 16)
    counts = torch.tensor([3, 0, 6, 2])  # an expert without tokens
    grads = []
    for grouped in (True, False):
        experts.grouped = grouped
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        grads.append((y.detach(), xi.grad, experts.w_gate.grad.clone(), experts.b_down.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_exactly_the_reference_choices(policy):
    cfg = make_cfg(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy)
    layer = make_layer(cfg)
    x = torch.randn(2, 8, cfg.hidden_size)
    probs, indices, _ = layer.router(x)
    routing = build_routing_map(probs, indices, 8, 0.5, policy)
    chosen, weights = indices.tolist(), probs.tolist()
    capacity = math.ceil(16 * 2 / 8 * 0.5)
    kept = ref.kept_choices(chosen, weights, 8, capacity, policy)
    assert {tuple(p) for p in routing.routing_map.nonzero().tolist()} == kept
    assert int(routing.num_dropped) == 32 - len(kept) > 0
    torch.testing.assert_close(layer(x).double(), ref.moe_layer_reference(layer, x, cfg), atol=2e-6, rtol=1e-5)


def test_dropless_routes_every_choice():
    cfg = make_cfg()
    layer = make_layer(cfg)
    probs, indices, _ = layer.router(torch.randn(2, 8, cfg.hidden_size))
    routing = build_routing_map(probs, indices, 8)
    assert int(routing.routing_map.sum()) == 32 and int(routing.num_dropped) == 0


@pytest.mark.parametrize("alignment", [4, 16])
def test_padding_aligns_counts_and_never_changes_outputs(alignment):
    cfg = make_cfg()
    layer = make_layer(cfg)
    x = torch.randn(2, 16, cfg.hidden_size, requires_grad=True)
    plain = layer(x)
    g_plain = torch.autograd.grad(plain.sum(), x)[0]
    layer.pad_alignment = alignment
    padded = layer(x)
    g_padded = torch.autograd.grad(padded.sum(), x)[0]
    probs, indices, _ = layer.router(x)
    routing = build_routing_map(probs, indices, 8, pad_alignment=alignment)
    counts = routing.routing_map.sum(0)
    assert bool((counts % alignment == 0).all()) and int(counts.sum()) > 64
    # equal up to GEMM blocking (an expert's rows are multiplied in a different-sized group)
    torch.testing.assert_close(plain, padded, atol=1e-6, rtol=0)
    torch.testing.assert_close(g_plain, g_padded, atol=1e-6, rtol=0)


def test_expert_bias_moves_toward_balance():
    cfg = make_cfg(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    layer = make_layer(cfg)
    layer.router.expert_bias.zero_()
    layer.train()
    layer(torch.randn(2, 8, cfg.hidden_size))
    load = layer.stats.tokens_per_expert.clone()
    metrics = end_of_step(layer)
    expected = 0.01 * torch.sign(load.mean() - load).float()
    torch.testing.assert_close(layer.router.expert_bias, expected)
    assert metrics["moe_load_max_"] == pytest.approx(float(load.max() / load.mean()))  # a bare layer's name is ''
    assert layer.stats.num_forwards == 0


def test_aux_loss_gradient_reaches_the_router_with_its_scale():
    """d/dW of sum(y * g) with the aux attached at scale s == d/dW of sum(y * g) + s * aux."""
    cfg = make_cfg(moe_z_loss_coeff=0.01)
    layer = make_layer(cfg)
    x = torch.randn(2, 8, cfg.hidden_size)
    g = torch.randn(2, 8, cfg.hidden_size)
    layer.aux_loss_scale = 0.25
    (layer(x) * g).sum().backward()
    got = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.aux_loss_scale = 0.0
    y = layer(x)
    _, _, aux = layer.router(x)
    ((y * g).sum() + 0.25 * aux).backward()
    torch.testing.assert_close(got, layer.router.weight.grad)
    assert got.abs().sum() > 0


def test_jitter_only_in_training_and_in_input_dtype():
    cfg = make_cfg(moe_input_jitter_eps=0.1, moe_router_dtype="input")
    layer = make_layer(cfg)
    x = torch.randn(2, 8, cfg.hidden_size)
    layer.eval()
    p1, i1, _ = layer.router(x)
    p2, i2, _ = layer.router(x)
    assert torch.equal(p1, p2) and p1.dtype == torch.float32
    layer.train()
    p3, _, _ = layer.router(x)
    assert not torch.equal(p1, p3)


def test_jitter_noise_is_drawn_in_bf16_within_eps(monkeypatch):
    """bf16 input, fp32 router: the router's linear layer sees x * noise with the noise drawn in bf16
    from the global generator, every factor in [1-eps, 1+eps] (eps well above bf16's resolution)."""
    eps = 0.25
    cfg = make_cfg(moe_input_jitter_eps=eps)
    layer = make_layer(cfg).train()
    seen = []
    logits = layer.router.logits
    monkeypatch.setattr(layer.router, "logits", lambda t: seen.append(t) or logits(t))
    x = (torch.rand(4, 16, cfg.hidden_size) + 0.5).to(torch.bfloat16)  # away from 0: the ratio below is exact-ish
    torch.manual_seed(123)
    layer.router(x)
    (jittered,) = seen
    assert jittered.dtype == torch.bfloat16
    torch.manual_seed(123)
    noise = torch.empty(x.numel() // cfg.hidden_size, cfg.hidden_size, dtype=torch.bfloat16).uniform_(1 - eps, 1 + eps)
    assert torch.equal(jittered, x.reshape(-1, cfg.hidden_size) * noise)
    ratio = jittered.float() / x.reshape(-1, cfg.hidden_size).float()
    slack = 2 * 2.0**-8  # two bf16 roundings (noise, product)
    assert ratio.min() >= 1 - eps - slack and ratio.max() <= 1 + eps + slack
    assert ratio.min() < 1 - eps / 2 and ratio.max() > 1 + eps / 2  # the noise spans the interval


def test_register_router_checks_the_protocol():
    from meshtron.nn.moe import ROUTERS, register_router

    class NoForward(torch.nn.Module):
        pass

    class TwoInputs(torch.nn.Module):
        def forward(self, x, y):
            return x, y, x

    class NotAModule:
        def forward(self, x):
            return x, x, x

    for cls, match in ((NoForward, "defines no forward"), (TwoInputs, "forward must take one argument x"),
                       (NotAModule, "must be a torch.nn.Module subclass")):
        with pytest.raises(TypeError, match=f"router 'bad'.*{match}"):
            register_router("bad")(cls)
    assert "bad" not in ROUTERS


def test_config_errors_name_the_field():
    from meshtron.config.fields import ConfigError

    with pytest.raises(ConfigError, match="model.moe_router_group_topk"):
        make_cfg(moe_router_num_groups=4)
    with pytest.raises(ConfigError, match="model.num_moe_experts"):
        ModelConfig(layer_pattern="*E").validate()
    with pytest.raises(ConfigError, match="model.moe_router_type"):
        MoELayer(dataclasses.replace(make_cfg(), moe_router_type="nope"))
    assert make_cfg(num_layers=3, moe_layer_freq=[0, 1, 1]).pattern == "*-*E*E"
    assert make_cfg(num_layers=3, moe_layer_freq=2).pattern == "*E*-*E"


def test_traced_forward_is_the_balanced_dropless_forward():
    """The static-shaped path taken for fake tensors (meshtron plan) computes what the real path does
    when routing happens to load every expert evenly."""
    from meshtron.nn.moe import ReplayMode, set_replay_mode, set_replay_targets

    cfg = make_cfg(num_moe_experts=4, moe_shared_expert_intermediate_size=8)
    layer = make_layer(cfg)
    x = torch.randn(2, 4, cfg.hidden_size)
    balanced = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]] * 2)  # every expert chosen 4 times
    set_replay_targets(layer, {"router": [balanced, balanced]})
    set_replay_mode(layer, ReplayMode.REPLAY_FORWARD)
    expected = layer(x)
    probs, indices, aux = layer.router(x)
    traced = layer._traced_forward(x.reshape(-1, cfg.hidden_size), probs, indices, aux)
    torch.testing.assert_close(traced.view_as(expected), expected, atol=1e-6, rtol=1e-5)


def test_plan_activations_of_moe_match_a_balanced_real_forward():
    """meshtron plan traces MoE sublayers with fake tensors (balanced, dropless); a real forward whose
    routing is balanced (replayed) saves nearly the same bytes (the index bookkeeping differs)."""
    from meshtron.config.loader import load_config
    from meshtron.models.gpt import GPTModel
    from meshtron.nn.context import PackedContext
    from meshtron.nn.loss import masked_cross_entropy
    from meshtron.nn.moe import ReplayMode, replays, set_replay_mode
    from meshtron.parallel.plan import SavedTensorCounter, estimate_memory

    cfg = load_config(overrides={"model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
                                 "model.ffn_hidden_size": "64", "model.num_moe_experts": "4", "model.vocab_size": "256",
                                 "data.seq_length": "32", "train.micro_batch_size": "2", "train.global_batch_size": "2",
                                 "model.moe_shared_expert_intermediate_size": "32"})
    (row,) = estimate_memory(cfg, 1)
    torch.manual_seed(0)
    model = GPTModel(cfg.model)
    balanced = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]] * 16)  # 64 tokens, every expert chosen 32 times
    for replay in replays(model).values():
        replay.targets.append(balanced)
    set_replay_mode(model, ReplayMode.REPLAY_FORWARD)
    tokens = torch.randint(0, 256, (2, 32))
    with SavedTensorCounter(model) as counter:
        masked_cross_entropy(model(tokens, PackedContext.for_tokens(tokens)), tokens, torch.ones(2, 32))
        real = counter.total
    assert row["activation_bytes"] == pytest.approx(real, rel=0.02)


def test_fp32_router_under_bf16_autocast():
    cfg = make_cfg()
    layer = make_layer(cfg)
    x = torch.randn(2, 4, cfg.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layer.router.logits(x.reshape(-1, cfg.hidden_size))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.reshape(-1, cfg.hidden_size) @ layer.router.weight.t())


def test_config_lists_exactly_the_built_in_routers():
    # config/ checks router names without importing nn/ (it sits below): its built-in list must be what
    # nn/moe/router.py registers when imported (every registration there is a built-in)
    import json
    import subprocess
    import sys

    code = ("import json; from meshtron.config.registry import ROUTER_REGISTRY as R; before = set(R.registered); "
            "import meshtron.nn.moe.router; print(json.dumps([sorted(set(R.registered) - before), sorted(R.builtin)]))")
    registered, builtin = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                    check=True).stdout)
    assert registered == builtin
