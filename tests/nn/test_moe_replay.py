"""Router replay: recorded routing replays exactly (indices, bitwise outputs and gradients), also
through activation recompute, and REPLAY_BACKWARD serves a recomputed forward."""

from __future__ import annotations

import pytest
import torch

from meshtron.config.schema import ModelConfig
from meshtron.models.gpt import GPTModel
from meshtron.nn.moe import ReplayMode, clear_replay, recorded_routing, replays, set_replay_mode, set_replay_targets
from meshtron.parallel.activation_checkpoint import apply_activation_checkpoint

CFG = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=8,
           moe_router_topk=2, vocab_size=64, make_vocab_size_divisible_by=1, moe_z_loss_coeff=0.01,
           init_method_std=0.2)


def model(**kw) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(ModelConfig(**{**CFG, **kw}))


def forward_backward(m: GPTModel, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m.zero_grad()
    logits = m(tokens)
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def negate_routers(m: GPTModel) -> None:
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("router.weight"):
                p.neg_()


def test_replay_is_bitwise_and_overrides_the_router():
    m = model()
    tokens = torch.randint(0, 64, (2, 12))
    set_replay_mode(m, ReplayMode.RECORD)
    out, grads = forward_backward(m, tokens)
    recorded = recorded_routing(m)
    assert set(recorded) == {"layers.1.mixer.router", "layers.3.mixer.router"}
    set_replay_targets(m, recorded)
    set_replay_mode(m, ReplayMode.REPLAY_FORWARD)
    out2, grads2 = forward_backward(m, tokens)
    assert torch.equal(out, out2)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)
    # with negated router weights free routing changes; replay still picks the recorded experts and
    # weighs them by this forward's scores
    negate_routers(m)
    router = m.layers[1].mixer.router
    x = torch.randn(2, 12, 16)
    set_replay_mode(m, ReplayMode.RECORD)
    _, free, _ = router(x)
    set_replay_targets(m, {"layers.1.mixer.router": [recorded["layers.1.mixer.router"][0]]})
    set_replay_mode(m, ReplayMode.REPLAY_FORWARD)
    probs, indices, _ = router(x)
    target = recorded["layers.1.mixer.router"][0]
    assert torch.equal(indices, target) and not torch.equal(free.sort(-1).values, target.sort(-1).values)
    logits = router.logits(x.reshape(-1, 16))
    torch.testing.assert_close(probs, torch.softmax(logits.gather(1, target), -1))


def test_replay_through_activation_recompute():
    tokens = torch.randint(0, 64, (2, 12))
    plain, recomputed = model(), model()
    apply_activation_checkpoint(recomputed, "full")
    set_replay_mode(recomputed, ReplayMode.RECORD)
    forward_backward(recomputed, tokens)
    recorded = recorded_routing(recomputed)
    assert all(len(v) == 1 for v in recorded.values())  # the recompute in backward records nothing
    results = []
    for m in (plain, recomputed):
        negate_routers(m)
        set_replay_targets(m, recorded)
        set_replay_mode(m, ReplayMode.REPLAY_FORWARD)
        results.append(forward_backward(m, tokens))
        assert not any(r.targets for r in replays(m).values())
    # only the recomputing model consumed what replayed forwards keep for backward
    assert all(len(r._for_backward) == 1 for r in replays(plain).values())
    assert not any(r._for_backward for r in replays(recomputed).values())
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_replay_backward_serves_a_recomputed_forward_and_errors_when_empty():
    m = model()
    tokens = torch.randint(0, 64, (1, 8))
    set_replay_mode(m, ReplayMode.RECORD)
    with torch.no_grad():
        first = m(tokens)
    set_replay_targets(m, recorded_routing(m))
    set_replay_mode(m, ReplayMode.REPLAY_FORWARD)
    negate_routers(m)
    with torch.no_grad():
        replayed = m(tokens)
        set_replay_mode(m, ReplayMode.REPLAY_BACKWARD)
        again = m(tokens)  # as activation recompute would run it
    assert torch.equal(replayed, again) and not torch.equal(first, replayed)
    with pytest.raises(RuntimeError, match="no recorded routing left"):
        m(tokens)


class _ArgmaxRouter(torch.nn.Module):
    """A user's top-1 router; with `replayable` it picks through a RouterReplay like the built-in one."""

    def __init__(self, cfg, replayable: bool):
        super().__init__()
        from meshtron.nn.moe import RouterReplay

        self.proj = torch.nn.Linear(cfg.hidden_size, cfg.num_moe_experts, bias=False)
        if replayable:
            self.replay = RouterReplay()

    def forward(self, x):
        scores = torch.softmax(self.proj(x.reshape(-1, x.shape[-1])), dim=-1)
        choose = lambda s: s.argmax(-1, keepdim=True)  # noqa: E731
        indices = self.replay.select(scores, choose) if hasattr(self, "replay") else choose(scores)
        return scores.gather(1, indices), indices, scores.new_zeros(())


def _register_test_routers():
    from meshtron.nn.moe import register_router

    @register_router("test_argmax_no_replay")
    class NoReplay(_ArgmaxRouter):
        def __init__(self, cfg):
            super().__init__(cfg, replayable=False)

    @register_router("test_argmax_replay")
    class WithReplay(_ArgmaxRouter):
        def __init__(self, cfg):
            super().__init__(cfg, replayable=True)


_register_test_routers()


def test_replay_refuses_a_custom_router_without_replay_support():
    m = model(moe_router_type="test_argmax_no_replay", moe_router_topk=1)
    for mode in ReplayMode:
        with pytest.raises(ValueError, match=r"layers\.1\.mixer \(NoReplay\) has no replay support"):
            set_replay_mode(m, mode)
    set_replay_mode(m, None)  # routing normally needs nothing
    assert replays(m) == {}


def test_custom_router_with_a_router_replay_records_and_replays():
    m = model(moe_router_type="test_argmax_replay", moe_router_topk=1)
    tokens = torch.randint(0, 64, (2, 12))
    set_replay_mode(m, ReplayMode.RECORD)
    out, grads = forward_backward(m, tokens)
    recorded = recorded_routing(m)
    assert set(recorded) == {"layers.1.mixer.router", "layers.3.mixer.router"}
    with torch.no_grad():  # free routing would now choose differently
        for layer in (1, 3):
            m.layers[layer].mixer.router.proj.weight.neg_()
    router, target = m.layers[1].mixer.router, recorded["layers.1.mixer.router"][0]
    x = torch.randn(2, 12, 16)
    set_replay_mode(m, None)
    assert not torch.equal(router(x)[1], target)
    set_replay_targets(m, {"layers.1.mixer.router": [target]})
    set_replay_mode(m, ReplayMode.REPLAY_FORWARD)
    assert torch.equal(router(x)[1], target)
    clear_replay(m)
    set_replay_targets(m, recorded)
    with torch.no_grad():
        for layer in (1, 3):
            m.layers[layer].mixer.router.proj.weight.neg_()
    out2, grads2 = forward_backward(m, tokens)
    assert torch.equal(out, out2) and all(torch.equal(grads[n], grads2[n]) for n in grads)
