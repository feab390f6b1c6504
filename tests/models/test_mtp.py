"""Multi-token prediction: shifted targets against a naive loop, the combined loss against per-token
sums, depth-k logits rebuilt by hand from the modules, causality (depth k at position i sees tokens
up to i + k only), and the trainer logging the MTP losses separately."""

from __future__ import annotations

import json

import torch

from meshtron.config import ModelConfig
from meshtron.models import GPTModel
from meshtron.models.mtp import combine_losses, forward_for_loss, mtp_targets
from meshtron.nn.context import PackedContext


def small(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                max_position_embeddings=64, make_vocab_size_divisible_by=8, mtp_num_layers=2)
    return ModelConfig(**{**base, **kw})


def test_mtp_targets_equal_naive_loop():
    labels = torch.randint(0, 50, (2, 9))
    loss_mask = (torch.rand(2, 9) > 0.2).float()
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0] * 9])
    for k in (1, 2, 3):
        targets, mask = mtp_targets(labels, loss_mask, docs, k)
        for b in range(2):
            for i in range(9):
                valid = i + k < 9 and docs[b, i + k] == docs[b, i] and loss_mask[b, i + k] == 1
                assert mask[b, i].item() == float(valid)
                if valid:
                    assert targets[b, i] == labels[b, i + k]


def test_combined_loss_is_main_plus_scaled_depth_sums():
    torch.manual_seed(0)
    cfg = small(mtp_loss_scaling_factor=0.3)
    model = GPTModel(cfg, 50).train()
    tokens = torch.randint(0, 50, (2, 10))
    labels = torch.randint(0, 50, (2, 10))
    ctx = PackedContext.for_tokens(tokens)
    logits, mtp_logits = forward_for_loss(model, tokens, ctx)
    assert len(mtp_logits) == 2
    total, count, extras = combine_losses(logits, mtp_logits, labels, None, None, cfg)

    def token_sum(lg, pairs):
        return sum(-torch.log_softmax(lg[b, i], -1)[t] for b, i, t in pairs)

    main = token_sum(logits, [(b, i, labels[b, i]) for b in range(2) for i in range(10)])
    depth = [token_sum(mtp_logits[k - 1], [(b, i, labels[b, i + k]) for b in range(2) for i in range(10 - k)])
             for k in (1, 2)]
    torch.testing.assert_close(total, main + 0.3 / 2 * (depth[0] + depth[1]), atol=1e-4, rtol=1e-6)
    assert count.item() == 20
    assert extras["mtp_1_loss"][1].item() == 18 and extras["mtp_2_loss"][1].item() == 16
    torch.testing.assert_close(extras["mtp_2_loss"][0], depth[1].detach(), atol=1e-4, rtol=1e-6)
    # eval mode (and models without MTP) skip the depths
    assert forward_for_loss(model.eval(), tokens, ctx)[1] == []


def test_depth_logits_rebuilt_from_modules():
    torch.manual_seed(0)
    model = GPTModel(small(mtp_num_layers=1), 50).eval()
    tokens = torch.randint(0, 50, (1, 8))
    _, (depth1,) = model(tokens, return_mtp=True)
    ctx = PackedContext.for_tokens(tokens)
    ctx.rope = model.rotary(ctx.positions)
    h = model.embedding(tokens)
    for layer in model.layers:
        h = layer(h, ctx)
    m = model.mtp[0]
    nxt = torch.cat([tokens[:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)  # t_{i+1}
    x = m.eh_proj(torch.cat([m.hidden_norm(h), m.embed_norm(model.embedding(nxt))], -1))
    for layer in m.layers:
        x = layer(x, ctx)
    torch.testing.assert_close(depth1, model.output(m.final_norm(x)), atol=1e-6, rtol=0)


def test_depth_k_sees_tokens_up_to_i_plus_k():
    torch.manual_seed(0)
    model = GPTModel(small(), 50).eval()
    tokens = torch.randint(0, 50, (1, 12))
    _, before = model(tokens, return_mtp=True)
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 50
    _, after = model(changed, return_mtp=True)
    for k, (a, b) in enumerate(zip(before, after), start=1):
        same = (a - b).abs().amax(-1)[0] < 1e-6
        assert same[: 7 - k].all() and not same[7 - k]  # position 7-k is the first to see token 7


def test_trainer_logs_mtp_losses_separately(tiny_config):
    from meshtron.training import Trainer

    cfg = tiny_config(**{"model.mtp_num_layers": "1", "train.train_iters": "2"})
    trainer = Trainer(cfg, echo=False)
    history = trainer.train()
    extra = history[-1].extra
    assert set(extra) == {"lm_loss", "mtp_1_loss"}
    # the objective adds 0.1 * (depth loss sum) / (main tokens), so it sits just above the LM loss
    assert extra["lm_loss"] < history[-1].loss < extra["lm_loss"] + 0.1 * extra["mtp_1_loss"] + 1e-6
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert train_rows and all("mtp_1_loss" in r and "lm_loss" in r for r in train_rows)
    assert train_rows[-1]["mtp_1_loss"] == extra["mtp_1_loss"]  # log_interval 1: the window is one step
    mtp_grad = [p for n, p in trainer.model.named_parameters() if n.startswith("mtp.")]
    assert mtp_grad and all(torch.isfinite(p).all() for p in mtp_grad)
