"""The Mamba-2 mixer in a hybrid model: decoding token by token after a prefill equals the full
forward; a prompt fed in pieces equals one prefill; packed documents equal separate forwards; right
padding leaves each row's state where its last real token put it; the init of A, D and dt."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import ModelConfig
from meshtron.models import GPTModel
from meshtron.nn.context import KVCacheContext, PackedContext, RecurrentState
from meshtron.nn.mamba import Mamba2Mixer


def hybrid(**kw) -> GPTModel:
    base = dict(layer_pattern="M*-M-M", hidden_size=32, num_attention_heads=4, vocab_size=64, mamba_head_dim=8,
                mamba_num_groups=2, mamba_state_dim=6, mamba_chunk_size=4, max_position_embeddings=64)
    cfg = ModelConfig(**{**base, **kw})
    cfg.validate()
    torch.manual_seed(0)
    return GPTModel(cfg).eval()


def feed(model, tokens, pieces) -> torch.Tensor:
    """Logits of `tokens` fed as consecutive pieces of the given lengths through one cache context."""
    ctx = KVCacheContext(tokens.shape[0], tokens.shape[1])
    out, at = [], 0
    for n in pieces:
        piece = tokens[:, at:at + n]
        out.append(model(piece, ctx.begin(piece)))
        ctx.advance()
        at += n
    return torch.cat(out, 1)


@torch.no_grad()
def test_decode_after_prefill_equals_full_forward():
    model = hybrid()
    tokens = torch.randint(0, 64, (2, 15))
    full = model(tokens)
    decoded = feed(model, tokens, [6] + [1] * 9)  # prefill 6, then 9 single-token recurrent steps
    torch.testing.assert_close(decoded, full, atol=2e-6, rtol=0)


@pytest.mark.parametrize("pieces", [[5, 6, 4], [1, 14], [8, 7], [3, 3, 3, 3, 3]])
@torch.no_grad()
def test_chunked_prefill_equals_one_prefill(pieces):
    model = hybrid()
    tokens = torch.randint(0, 64, (2, 15))
    one = feed(model, tokens, [15])
    torch.testing.assert_close(feed(model, tokens, pieces), one, atol=2e-6, rtol=0)
    torch.testing.assert_close(one, model(tokens), atol=2e-6, rtol=0)


@torch.no_grad()
def test_packed_documents_equal_separate_forwards():
    model = hybrid(mamba_conv_kernel=3)
    docs = [torch.randint(0, 64, (1, n)) for n in (5, 1, 9)]
    packed = torch.cat(docs, 1)
    ids = torch.cat([torch.full((d.shape[1],), i) for i, d in enumerate(docs)])[None]
    positions = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    out = model(packed, PackedContext.for_tokens(packed, ids, positions))
    torch.testing.assert_close(out, torch.cat([model(d) for d in docs], 1), atol=2e-6, rtol=0)


@torch.no_grad()
def test_right_padding_leaves_each_rows_state_at_its_last_real_token():
    torch.manual_seed(0)
    mixer = Mamba2Mixer(16, 4, 4, 2, 3, layer_id=0, chunk_size=4).eval()
    u = torch.randn(3, 9, 16)
    lengths = torch.tensor([9, 4, 1])
    stored = {}
    padded_ctx = type("Ctx", (), {"mamba_states": lambda self, i: [RecurrentState(
        None, None, lengths, lambda conv, ssm: stored.update(padded=(conv, ssm)))]})()
    out = mixer(u, padded_ctx)
    for row, n in enumerate(lengths.tolist()):
        one_ctx = type("Ctx", (), {"mamba_states": lambda self, i: [RecurrentState(
            None, None, None, lambda conv, ssm: stored.update(one=(conv, ssm)))]})()
        alone = mixer(u[row:row + 1, :n], one_ctx)
        torch.testing.assert_close(out[row:row + 1, :n], alone, atol=1e-6, rtol=0)
        torch.testing.assert_close(stored["padded"][0][row], stored["one"][0][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(stored["padded"][1][row], stored["one"][1][0], atol=1e-6, rtol=0)


def test_init_of_a_d_and_dt():
    torch.manual_seed(0)
    mixer = Mamba2Mixer(32, 64, 4, 8, 3, layer_id=0, dt_min=0.01, dt_max=0.05, dt_init_floor=0.02)
    A = -torch.exp(mixer.A_log)
    assert (A <= -1).all() and (A >= -16).all() and A.std() > 1  # spread over [-16, -1]
    assert torch.equal(mixer.D, torch.ones(64))
    dt = F.softplus(mixer.dt_bias)
    assert (dt >= 0.02 - 1e-6).all() and (dt <= 0.05 + 1e-6).all()  # the floor clamps [0.01, 0.02) up
    assert (dt - 0.02).abs().min() < 1e-6
    bound = 1 / 2  # 1 / sqrt(kernel 4)
    assert mixer.conv_x.weight.abs().max() <= bound and torch.equal(mixer.conv_x.bias, torch.zeros(256))


def test_training_backward_reaches_every_mamba_parameter():
    model = hybrid().train()
    tokens = torch.randint(0, 64, (2, 11))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_gated_norm_backward_equals_autograd_of_the_formula():
    from meshtron.nn.mamba import GatedRMSNormFunction

    g = torch.Generator().manual_seed(0)
    x, z = (torch.randn(2, 5, 12, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(12, dtype=torch.float64, generator=g, requires_grad=True)

    def formula(x, z, w):  # rmsnorm over groups of 4 of x * silu(z), times w
        h = (x * F.silu(z)).view(2, 5, 3, 4)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).view(2, 5, 12) * w

    dy = torch.randn(2, 5, 12, dtype=torch.float64, generator=g)
    ours = torch.autograd.grad((GatedRMSNormFunction.apply(x, z, w, 4, 1e-5) * dy).sum(), (x, z, w))
    ref = torch.autograd.grad((formula(x, z, w) * dy).sum(), (x, z, w))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_recomputed_scan_gives_the_same_gradients():
    grads = []
    for recompute in (False, True):
        model = hybrid(mamba_recompute_scan=recompute).train()
        tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=0, msg=name)
