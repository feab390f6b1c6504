"""Weight decay grouping by role (biases incl. stacked expert biases, norms incl. q/k and Mamba's gated
norm, A_log/D/dt_bias get none) and Adam (L2) vs AdamW equal to torch's own optimizers."""

from __future__ import annotations

import copy

import pytest
import torch

from meshtron.config.schema import ModelConfig, OptimizerConfig
from meshtron.models.gpt import GPTModel
from meshtron.training.optimizer import build_optimizer, decay_names

DECAYED = [
    "embedding.weight",
    "layers.0.mixer.wq.weight", "layers.0.mixer.wk.weight", "layers.0.mixer.wv.weight", "layers.0.mixer.wo.weight",
    "layers.1.mixer.w_gate.weight", "layers.1.mixer.w_up.weight", "layers.1.mixer.w_down.weight",
    "layers.2.mixer.router.weight",
    "layers.2.mixer.experts.w_gate", "layers.2.mixer.experts.w_up", "layers.2.mixer.experts.w_down",
    "layers.3.mixer.z_proj.weight", "layers.3.mixer.x_proj.weight", "layers.3.mixer.b_proj.weight",
    "layers.3.mixer.c_proj.weight", "layers.3.mixer.dt_proj.weight",
    "layers.3.mixer.conv_x.weight", "layers.3.mixer.conv_b.weight", "layers.3.mixer.conv_c.weight",
    "layers.3.mixer.out_proj.weight",
    "output.weight",
]


def tiny_hybrid() -> GPTModel:
    """Attention with qkv/out biases and QK-norm, a biased MLP, MoE with per-expert biases, a Mamba layer."""
    cfg = ModelConfig(layer_pattern="*-EM", hidden_size=16, num_attention_heads=2, num_query_groups=1,
                      ffn_hidden_size=32, vocab_size=64, add_bias_linear=True, add_qkv_bias=True, qk_layernorm=True,
                      num_moe_experts=2, moe_router_topk=1, mamba_num_heads=2, mamba_head_dim=8, mamba_num_groups=1,
                      mamba_state_dim=4, mamba_chunk_size=4, tie_word_embeddings=False)
    cfg.validate()
    torch.manual_seed(0)
    return GPTModel(cfg)


def test_decay_goes_to_weight_matrices_only():
    model = tiny_hybrid()
    decay, no_decay = decay_names(model)
    assert decay == DECAYED
    everything = [n for n, _ in model.named_parameters()]
    assert sorted(decay + no_decay) == sorted(everything)
    # the 2-D stacked expert biases are the case a shape rule gets wrong
    shapes = dict(model.named_parameters())
    assert shapes["layers.2.mixer.experts.b_up"].ndim == 2
    for name in ("layers.2.mixer.experts.b_gate", "layers.2.mixer.experts.b_up", "layers.2.mixer.experts.b_down",
                 "layers.0.mixer.q_norm.weight", "layers.0.mixer.k_norm.weight", "layers.3.mixer.norm.weight",
                 "layers.3.mixer.A_log", "layers.3.mixer.D", "layers.3.mixer.dt_bias", "final_norm.weight"):
        assert name in no_decay
    groups = build_optimizer(model, OptimizerConfig(weight_decay=0.1)).param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert {id(p) for p in groups[0]["params"]} == {id(shapes[n]) for n in DECAYED}


@pytest.mark.parametrize("decoupled, reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_adam_and_adamw_match_torch(decoupled, reference):
    model = tiny_hybrid()
    twin = copy.deepcopy(model)
    cfg = OptimizerConfig(lr=0.01, weight_decay=0.3, decoupled_weight_decay=decoupled, adam_beta1=0.8,
                          adam_beta2=0.95, adam_eps=1e-6)
    ours = build_optimizer(model, cfg)
    params = dict(twin.named_parameters())
    decayed = [params[n] for n in DECAYED]
    rest = [p for n, p in params.items() if n not in DECAYED]
    theirs = reference([{"params": decayed, "weight_decay": 0.3}, {"params": rest, "weight_decay": 0.0}],
                       lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for (_, p), q in zip(model.named_parameters(), twin.parameters()):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    # the two rules really differ: the same steps under the other rule end somewhere else
    other = torch.optim.Adam if decoupled else torch.optim.AdamW
    third = tiny_hybrid()
    named = list(third.named_parameters())
    opt = other([{"params": [p for n, p in named if n in DECAYED], "weight_decay": 0.3},
                 {"params": [p for n, p in named if n not in DECAYED], "weight_decay": 0.0}],
                lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    wq = "layers.0.mixer.wq.weight"
    assert not torch.allclose(dict(named)[wq], dict(model.named_parameters())[wq], rtol=0, atol=1e-6)
