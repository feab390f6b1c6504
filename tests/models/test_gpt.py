"""GPT model: closed-form parameter counts and FLOPs for every architecture option, packed-document
masking, KV-cache decoding (windows, sinks, MLA included), and overfitting one batch."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.models import GPTModel, count_parameters, flops_per_token
from meshtron.nn.context import KVCacheContext, PackedContext

MLA = {"multi_latent_attention": True, "q_lora_rank": 12, "kv_lora_rank": 10, "qk_head_dim": 6,
       "qk_pos_emb_head_dim": 4, "v_head_dim": 5}
VARIANTS = [
    {},
    {"normalization": "LayerNorm", "activation": "gelu", "add_bias_linear": True, "add_qkv_bias": True},
    {"tie_word_embeddings": True, "position_embedding_type": "learned_absolute", "num_query_groups": 1},
    {"activation": "squared_relu", "kv_channels": 16, "layer_pattern": "**--*"},
    {"activation": "quick_geglu", "position_embedding_type": "none", "layer_pattern": "-*"},
    {"qk_layernorm": True, "softmax_type": "learnable", "window_size": 3, "window_attn_skip_freq": 2,
     "rotary_percent": 0.5, "rotary_interleaved": True},
    {"normalization": "LayerNorm", "qk_layernorm": True, "activation": "geglu_tanh", "add_bias_linear": True,
     "add_qkv_bias": True, "softmax_type": "off-by-one", "window_size": 4, "window_attn_skip_freq": [0, 1]},
    {**MLA, "position_embedding_type": "yarn", "yarn_rotary_scaling_factor": 4.0,
     "yarn_original_max_position_embeddings": 16, "yarn_mscale_all_dim": 1.0, "add_qkv_bias": True},
    {**MLA, "q_lora_rank": None, "normalization": "LayerNorm", "softmax_type": "learnable", "add_bias_linear": True},
    {"mtp_num_layers": 2, "activation": "quick_geglu", "activation_func_clamp_value": 7.0, "glu_linear_offset": 1.0,
     "rope_scaling": True, "rope_scaling_original_max_position_embeddings": 16},
    {"mtp_num_layers": 1, "normalization": "LayerNorm", "qk_layernorm": True, "softmax_type": "learnable",
     "tie_word_embeddings": True},
    {"layer_pattern": "M*-M", "mamba_head_dim": 8, "mamba_num_groups": 2, "mamba_state_dim": 4},
    {"layer_pattern": "MM-", "mamba_num_heads": 3, "mamba_head_dim": 5, "mamba_num_groups": 3, "mamba_state_dim": 7,
     "mamba_conv_kernel": 2, "mamba_conv_bias": False, "mamba_proj_bias": True, "normalization": "LayerNorm"},
]


def small(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                max_position_embeddings=64, make_vocab_size_divisible_by=8)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", VARIANTS)
def test_parameter_count_matches_closed_form(kw):
    cfg = small(**kw)
    cfg.validate()
    model = GPTModel(cfg, vocab_size=61)
    assert model.vocab_size == 64  # padded to a multiple of 8
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg, 61)


def test_parameter_count_by_hand():
    # d=32, 4 heads of 8, 2 kv groups, ffn 48, SwiGLU, RMSNorm, untied, vocab 64, pattern *-*-
    # attention: q 32*32 + k,v 2*32*16 + o 32*32 = 3072; mlp: 3*32*48 = 4608; norms 32 each (5 of them)
    expected = 64 * 32 * 2 + 2 * (3072 + 4608) + 5 * 32
    assert count_parameters(small(), 64) == expected


def test_flops_per_token_by_hand():
    cfg = small()
    # matmul params: head 64*32 + 2 * (3072 + 4608); attention term 12 * 2 layers * seq 16 * 4 heads * 8
    expected = 6 * (64 * 32 + 2 * (3072 + 4608)) + 12 * 2 * 16 * 4 * 8
    assert flops_per_token(cfg, 64, 16) == expected


def test_mamba_parameters_and_flops_by_hand():
    cfg = small(layer_pattern="M-", mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=4, mamba_chunk_size=8)
    # 4 heads of 16 (expand 2 x 32 / 16): inner 64, B and C 2 groups x 4 = 8 each, conv over 64 + 16 channels
    # projections 32 * (64 + 64 + 8 + 8 + 4) + 64 * 32; conv 80 * 4 + 80 bias; A_log, D, dt_bias 3 * 4; norm 64
    mamba = 32 * 148 + 64 * 32 + 80 * 4 + 80 + 12 + 64
    assert count_parameters(cfg, 64) == 64 * 32 * 2 + mamba + 4608 + 3 * 32  # + embedding, head, MLP, 3 norms
    # scan per token (x3 for training): conv 2*4*80, scores 2*8*2*4, scores x values 2*8*4*16, states 4*4*16*4
    scan = 3 * (2 * 4 * 80 + 2 * 8 * 2 * 4 + 2 * 8 * 4 * 16 + 4 * 4 * 16 * 4)
    assert flops_per_token(cfg, 64, 16) == 6 * (64 * 32 + 32 * 148 + 64 * 32 + 4608) + scan


def test_parameter_count_of_mla_and_mtp_by_hand():
    # MLA, d=32, 4 heads, q rank 12, kv rank 10, d_n 6, d_r 4, d_v 5, RMSNorm:
    # q: 32*12 + 12 (norm) + 12*4*10; kv: 32*(10+4) + 10 (norm) + 10*4*(6+5); out: 4*5*32
    attn = 32 * 12 + 12 + 12 * 4 * 10 + 32 * 14 + 10 + 10 * 4 * 11 + 4 * 5 * 32
    mlp = 3 * 32 * 48
    # MTP depth: 2 input norms + 2d*d projection + (norm + attention) + (norm + MLP) + final norm
    mtp = 2 * 32 + 2 * 32 * 32 + (32 + attn) + (32 + mlp) + 32
    expected = 64 * 32 * 2 + 2 * (attn + mlp) + 5 * 32 + mtp
    assert count_parameters(small(**MLA, mtp_num_layers=1), 64) == expected


def test_flops_of_windows_and_mla_by_hand():
    # a window of 4 keys in the second of two attention layers (every 2nd layer is full): keys 16 and 4
    cfg = small(window_size=4, window_attn_skip_freq=2)
    assert cfg.is_window_layer(0) and not cfg.is_window_layer(1)
    expected = 6 * (64 * 32 + 2 * (3072 + 4608)) + 12 * (4 + 16) * 4 * 8
    assert flops_per_token(cfg, 64, 16) == expected
    # MLA scores: 2 * keys * heads * (d_n + d_r) forward for q k^T, 2 * keys * heads * d_v for p v; x3 for training
    cfg = small(**MLA)
    attn_w = 32 * 12 + 12 * 4 * 10 + 32 * 14 + 10 * 4 * 11 + 4 * 5 * 32
    expected = 6 * (64 * 32 + 2 * (attn_w + 3 * 32 * 48)) + 2 * 6 * 16 * 4 * (6 + 4 + 5)
    assert flops_per_token(cfg, 64, 16) == expected


def test_shapes_and_loss_at_init():
    torch.manual_seed(0)
    model = GPTModel(small(), 64)
    logits = model(torch.randint(0, 64, (3, 10)))
    assert logits.shape == (3, 10, 64)
    # with std-0.02 init the logits are nearly uniform: loss ~ ln(vocab)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.randint(0, 64, (30,)))
    assert abs(loss.item() - torch.log(torch.tensor(64.0)).item()) < 0.05


def test_packed_documents_equal_separate_forwards():
    torch.manual_seed(0)
    model = GPTModel(small(), 64).eval()
    docs = [torch.randint(0, 64, (n,)) for n in (5, 9, 2)]
    packed = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    out = model(packed, PackedContext.for_tokens(packed, doc_ids, positions))
    ref = torch.cat([model(d[None]) for d in docs], dim=1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # without the mask, later documents would see earlier ones: the outputs must differ
    assert not torch.allclose(model(packed)[:, 5:], ref[:, 5:], atol=1e-3)


@pytest.mark.parametrize("kw", [{}, {"position_embedding_type": "learned_absolute"}] + VARIANTS[5:])
def test_kv_cache_decoding_equals_full_forward(kw):
    torch.manual_seed(0)
    model = GPTModel(small(**kw), 64).eval()
    tokens = torch.randint(0, 64, (2, 12))
    full = model(tokens)
    ctx = KVCacheContext(batch_size=2, max_len=12)
    pieces = []
    for a, b in [(0, 5), (5, 8), (8, 9), (9, 10), (10, 12)]:
        chunk = tokens[:, a:b]
        pieces.append(model(chunk, ctx.begin(chunk)))
        ctx.advance()
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPTModel(small(), 64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (4, 17))
    for _ in range(150):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05  # from ~4.16 (ln 64) at init


def test_scaled_init_of_output_projections():
    torch.manual_seed(0)
    cfg = small(hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, num_layers=8)
    model = GPTModel(cfg, 64)
    std_in = model.layers[0].mixer.wq.weight.std().item()
    std_out = model.layers[0].mixer.wo.weight.std().item()
    assert abs(std_in - 0.02) < 1e-3
    assert abs(std_out - 0.02 / 4.0) < 3e-4  # 1/sqrt(2 * 8 attention layers)


def test_nope_model_equals_naive_causal_attention_without_rotation():
    """position_embedding_type none: the forward is embedding -> [x + attn(norm x)] (naive causal
    attention over unrotated q, k) -> [x + mlp(norm x)] -> norm -> head; with RoPE it is not."""
    from tests.nn.test_attention_variants import naive_attention, projections

    torch.manual_seed(0)
    cfg = small(position_embedding_type="none", layer_pattern="*-*-")
    model = GPTModel(cfg, 64).double().eval()
    assert model.rotary is None and model.position_embedding is None
    tokens = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        logits = model(tokens)
        h = model.embedding(tokens)
        for layer in model.layers:
            x = layer.norm(h)
            if layer.symbol == "*":
                attn = layer.mixer
                q, k, v = projections(attn, x)
                out = naive_attention(q, k, v, scale=attn.head_dim ** -0.5)
                h = h + attn.wo(out.reshape(*x.shape[:2], -1))
            else:
                h = h + layer.mixer(x, None)
        expected = model.output(model.final_norm(h))
    torch.testing.assert_close(logits, expected, atol=1e-12, rtol=0)
    # the same weights with RoPE give other logits: the reference above would catch a stray rotation
    torch.manual_seed(0)
    roped = GPTModel(small(position_embedding_type="rope", layer_pattern="*-*-"), 64).double().eval()
    roped.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (roped(tokens) - logits).abs().max() > 1e-5  # vs the 1e-12 agreement above
