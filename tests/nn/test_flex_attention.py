"""FlexAttention path (nn/flex_attention.py): outputs and gradients against a float64 loop that writes
the masked softmax out row by row, the block structure against the dense mask, one block mask per
forward, whole-model equality with the SDPA path, and the backend choice (CPU keeps today's paths).

PyTorch 2.13 refuses flex's backward on a CPU in a public-API check; the gradient tests lift that
check (fixture `flex_backward_on_cpu`) so PyTorch's own dense backward of the flex operator runs. The
Triton kernel's backward is covered by the CUDA test.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

from meshtron.config.fields import ConfigError
from meshtron.config.schema import ModelConfig
from meshtron.models.gpt import GPTModel
from meshtron.nn import context as context_module
from meshtron.nn import flex_attention as flex_module
from meshtron.nn.attention_core import attend
from meshtron.nn.context import KVCacheContext, PackedContext


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """Let flex's eager (dense reference) backward run on a CPU: only the CPU refusal is lifted."""
    original = torch_flex._validate_device

    def validate(q, k, v):
        if q.device.type != "cpu":
            original(q, k, v)

    monkeypatch.setattr(torch_flex, "_validate_device", validate)


def reference_attention(q, k, v, document_ids: Optional[torch.Tensor], window: Optional[int],
                        sinks: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """float64, one query row at a time: allowed keys by the mask's definition, logits, an explicit
    softmax (with the sink's exp(s) in the denominator), weighted sum of values."""
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, seq, _ = q.shape
    group = heads // k.shape[1]
    keys = torch.arange(seq)
    rows = []
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                allowed = keys <= i
                if window is not None:
                    allowed = allowed & (i - keys < window)
                if document_ids is not None:
                    allowed = allowed & (document_ids[b] == document_ids[b, i])
                logits = scale * (k[b, h // group, allowed] @ q[b, h, i])
                weights = torch.exp(logits)
                denom = weights.sum() + (torch.exp(sinks[h].double()) if sinks is not None else 0.0)
                rows.append((weights / denom) @ v[b, h // group, allowed])
    return torch.stack(rows).view(batch, heads, seq, -1)


def packed_ids(batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """(batch, seq) document ids: each row cut at random points into 3 documents."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq - 1, generator=generator)[:2].add(1).sort().values
        rows.append(torch.bucketize(torch.arange(seq), cuts, right=True))
    return torch.stack(rows)


CASES = {
    "documents": dict(documents=True, window=None, sinks=None, kv_heads=4),
    "window": dict(documents=False, window=5, sinks=None, kv_heads=4),
    "documents_window": dict(documents=True, window=6, sinks=None, kv_heads=4),
    "sinks_off_by_one": dict(documents=True, window=None, sinks="off-by-one", kv_heads=4),
    "sinks_learnable": dict(documents=True, window=7, sinks="learnable", kv_heads=4),
    "gqa": dict(documents=True, window=6, sinks=None, kv_heads=2),
    "gqa_sinks_causal": dict(documents=False, window=None, sinks="learnable", kv_heads=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flex_matches_float64_reference(case, flex_backward_on_cpu):
    c = CASES[case]
    g = torch.Generator().manual_seed(0)
    batch, heads, seq, dim, scale = 2, 4, 37, 16, 0.3
    q = torch.randn(batch, heads, seq, dim, generator=g, requires_grad=True)
    k = torch.randn(batch, c["kv_heads"], seq, dim, generator=g, requires_grad=True)
    v = torch.randn(batch, c["kv_heads"], seq, dim, generator=g, requires_grad=True)
    docs = packed_ids(batch, seq, g) if c["documents"] else None
    sinks = None
    if c["sinks"] == "off-by-one":
        sinks = torch.zeros(heads)
    elif c["sinks"] == "learnable":
        sinks = torch.randn(heads, generator=g).requires_grad_()
    ctx = PackedContext.for_tokens(torch.zeros(batch, seq, dtype=torch.long), docs)
    out = attend(q, k, v, ctx, scale=scale, window_size=c["window"], sink_logits=sinks, backend="flex")
    ref = reference_attention(q, k, v, docs, c["window"], sinks, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn(out.shape, generator=g)
    inputs = [t for t in (q, k, v, sinks) if t is not None and t.requires_grad]
    grads = torch.autograd.grad((out * grad_out).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * grad_out.double()).sum(), inputs)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-5)


def reference_mask(docs: Optional[torch.Tensor], window: Optional[int], batch: int, seq: int) -> torch.Tensor:
    """(batch, seq, seq) boolean, entry by entry."""
    mask = torch.zeros(batch, seq, seq, dtype=torch.bool)
    for b in range(batch):
        for i in range(seq):
            for j in range(i + 1):
                in_window = window is None or i - j < window
                same_doc = docs is None or bool(docs[b, i] == docs[b, j])
                mask[b, i, j] = in_window and same_doc
    return mask


@pytest.mark.parametrize("documents,window", [(True, None), (False, 90), (True, 150)])
def test_block_mask_structure(documents, window):
    """Blocks the kernel visits = blocks with any allowed pair; blocks it runs without the mask = all allowed."""
    g = torch.Generator().manual_seed(1)
    batch, seq, size = 2, 300, 128  # 3 x 3 blocks, the last one partial
    docs = packed_ids(batch, seq, g) if documents else None
    block_mask = flex_module.build_block_mask(torch.zeros(batch, seq, dtype=torch.long), docs, window)
    assert block_mask.BLOCK_SIZE == (size, size)
    mask = reference_mask(docs, window, batch, seq)
    num_blocks = -(-seq // size)
    padded = torch.zeros(batch, num_blocks * size, num_blocks * size, dtype=torch.bool)
    padded[:, :seq, :seq] = mask
    tiles = padded.view(batch, num_blocks, size, num_blocks, size).transpose(2, 3)
    valid = torch.zeros_like(padded)
    valid[:, :seq, :seq] = True
    valid_tiles = valid.view(batch, num_blocks, size, num_blocks, size).transpose(2, 3)
    want_any = tiles.flatten(-2).any(-1)
    want_full = (tiles | ~valid_tiles).flatten(-2).all(-1) & want_any
    rows = block_mask.to_dense()[:, 0].bool()  # (batch or 1, q blocks, kv blocks)
    full = torch.zeros(rows.shape, dtype=torch.bool)
    for b in range(full.shape[0]):
        for qb in range(num_blocks):
            n = int(block_mask.full_kv_num_blocks[b, 0, qb])
            full[b, qb, block_mask.full_kv_indices[b, 0, qb, :n].long()] = True
    assert torch.equal(rows.expand(batch, -1, -1), want_any)
    assert torch.equal(full.expand(batch, -1, -1), want_full)


@pytest.mark.slow  # compiling flex for the CPU takes ~30 s on a loaded 2-core machine
def test_compiled_flex_matches_reference_without_recompiling():
    """The compiled kernel (block-sparse, unlike eager flex) over 3 x 3 blocks; new document ids
    (a new mask closure) in a second forward reuse the compiled kernel."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(2)
    batch, heads, seq, dim = 2, 4, 300, 16
    q = torch.randn(batch, heads, seq, dim, generator=g)
    k, v = (torch.randn(batch, 2, seq, dim, generator=g) for _ in range(2))
    with torch.no_grad():
        for step in range(2):
            docs = packed_ids(batch, seq, g)
            ctx = PackedContext.for_tokens(torch.zeros(batch, seq, dtype=torch.long), docs)
            out = flex_module.flex_attend(q, k, v, ctx.flex_block_mask(100), scale=0.25, compiled=True)
            ref = reference_attention(q, k, v, docs, 100, None, 0.25)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
            if step == 0:
                compiled_frames = counters["frames"]["ok"]
    assert compiled_frames > 0 and counters["frames"]["ok"] == compiled_frames


@pytest.mark.slow  # compiles every sublayer for the CPU (~1.5 min on a loaded 2-core machine)
def test_compiled_sublayers_with_flex_do_not_recompile_per_micro_batch():
    """parallel.compile's per-sublayer compile with flex: the block mask is built outside the compiled
    graphs, and a second micro-batch with other documents reuses every compiled graph (equal to SDPA)."""
    from torch._dynamo.utils import counters

    from meshtron.parallel.compile import apply_compile

    cfg = small_config(window_size=16, max_position_embeddings=256, attention_backend="flex")
    model = GPTModel(cfg).eval()
    reference = GPTModel(small_config(window_size=16, max_position_embeddings=256)).eval()
    reference.load_state_dict(model.state_dict())
    for layer in reference.layers:
        if hasattr(layer.mixer, "attention_backend"):
            layer.mixer.attention_backend = "sdpa"
    apply_compile(model)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # a compiled CPU flex kernel has no backward (PyTorch 2.13)
        for step in range(2):
            tokens = torch.randint(0, 128, (2, 200), generator=g)
            docs = packed_ids(2, 200, g)
            out = model(tokens, PackedContext.for_tokens(tokens, docs))
            torch.testing.assert_close(out, reference(tokens, PackedContext.for_tokens(tokens, docs)),
                                       rtol=1e-5, atol=1e-5)
            if step == 0:
                frames = counters["frames"]["total"]
    assert counters["frames"]["total"] == frames


def small_config(**overrides) -> ModelConfig:
    cfg = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
               max_position_embeddings=64, window_size=6, window_attn_skip_freq=2)
    cfg.update(overrides)
    return ModelConfig(**cfg)


def loss_and_grads(cfg: ModelConfig, tokens, docs, backend: str):
    torch.manual_seed(0)
    cfg.attention_backend = backend
    model = GPTModel(cfg)
    ctx = PackedContext.for_tokens(tokens, docs)
    logits = model(tokens, ctx)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("overrides", [
    dict(softmax_type="vanilla"),
    dict(softmax_type="learnable"),
    dict(softmax_type="off-by-one", window_size=None, window_attn_skip_freq=None),
    dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=8,
         softmax_type="learnable"),
], ids=["vanilla", "learnable", "off-by-one-causal", "mla"])
def test_gpt_model_flex_equals_sdpa(overrides, flex_backward_on_cpu):
    """The whole model (documents, windows on every other layer, GQA): loss and every gradient equal the
    SDPA / eager-sink path in fp32."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (2, 29), generator=g)
    docs = packed_ids(2, 29, g)
    cfg = small_config(**overrides)
    loss_sdpa, grads_sdpa = loss_and_grads(cfg, tokens, docs, "sdpa")
    loss_flex, grads_flex = loss_and_grads(cfg, tokens, docs, "flex")
    torch.testing.assert_close(loss_flex, loss_sdpa, rtol=1e-5, atol=1e-6)
    assert grads_flex.keys() == grads_sdpa.keys()
    for name in grads_sdpa:
        torch.testing.assert_close(grads_flex[name], grads_sdpa[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("window_attn_skip_freq,builds", [(2, 2), (None, 1)])
def test_block_mask_built_once_per_forward(monkeypatch, window_attn_skip_freq, builds):
    """4 attention layers: one block mask per distinct window size in a forward, not one per layer."""
    calls = []

    def counting(positions, document_ids, window_size):
        calls.append(window_size)
        return flex_module.build_block_mask(positions, document_ids, window_size)

    monkeypatch.setattr(context_module, "build_block_mask", counting)
    cfg = small_config(window_attn_skip_freq=window_attn_skip_freq, attention_backend="flex")
    model = GPTModel(cfg).eval()
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 128, (2, 20), generator=g)
    with torch.no_grad():
        model(tokens, PackedContext.for_tokens(tokens, packed_ids(2, 20, g)))
        assert sorted(calls, key=str) == sorted({6} | ({None} if window_attn_skip_freq else set()), key=str)
        assert len(calls) == builds
        model(tokens, PackedContext.for_tokens(tokens, packed_ids(2, 20, g)))  # a new micro-batch builds anew
    assert len(calls) == 2 * builds


def test_auto_on_cpu_keeps_todays_paths(monkeypatch):
    """auto on a CPU never reaches flex, whatever the mask or sinks."""
    def refuse(*args, **kwargs):
        raise AssertionError("flex used on a CPU under auto")

    monkeypatch.setattr("meshtron.nn.attention_core.flex_attend", refuse)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 128, (2, 20), generator=g)
    for softmax_type in ("vanilla", "learnable"):
        model = GPTModel(small_config(softmax_type=softmax_type))
        model(tokens, PackedContext.for_tokens(tokens, packed_ids(2, 20, g))).sum().backward()


def test_backend_choice():
    q_cpu = torch.zeros(1, 2, 4, 8)
    q_cuda = torch.zeros(1, 2, 4, 8, device="meta")
    assert not flex_module.use_flex("auto", q_cpu, masked=True, sinks=True, dropout=0.0)
    assert flex_module.use_flex("flex", q_cpu, masked=False, sinks=False, dropout=0.0)
    assert not flex_module.use_flex("sdpa", q_cpu, masked=True, sinks=True, dropout=0.0)
    with pytest.raises(ValueError, match="model.attention_backend"):
        flex_module.use_flex("flex", q_cpu, masked=True, sinks=False, dropout=0.1)
    assert not flex_module.use_flex("auto", q_cuda, masked=True, sinks=False, dropout=0.0)  # meta is no CUDA


def test_forced_flex_with_dropout_is_a_config_error():
    with pytest.raises(ConfigError, match="model.attention_backend"):
        small_config(attention_backend="flex", attention_dropout=0.1).validate()
    small_config(attention_backend="auto", attention_dropout=0.1).validate()


def test_flex_backward_on_cpu_names_the_field():
    """Without the test-only lift, PyTorch refuses flex's CPU backward: the error names the config field."""
    q = torch.randn(1, 2, 8, 8, requires_grad=True)
    ctx = PackedContext.for_tokens(torch.zeros(1, 8, dtype=torch.long), torch.tensor([[0] * 3 + [1] * 5]))
    with pytest.raises(ValueError, match="model.attention_backend"):
        attend(q, q, q, ctx, scale=0.3, backend="flex")


def test_kv_cache_context_keeps_sdpa_under_forced_flex():
    """Generation's contiguous cache has no block mask: forced flex leaves it on SDPA."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    ctx = KVCacheContext(batch_size=1, max_len=8).begin(torch.zeros(1, 5, dtype=torch.long))
    out = attend(q, k, v, ctx, scale=0.3, backend="flex")
    want = reference_attention(q, k, v, None, None, None, 0.3)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_on_cuda_bf16_matches_float64_reference():
    """The compiled Triton kernel, forward and backward, in bf16 (documents, a window, learnable sinks,
    GQA, a length that is no multiple of the block size) against the float64 loop."""
    g = torch.Generator().manual_seed(8)
    batch, heads, kv_heads, seq, dim, window, scale = 2, 4, 2, 300, 64, 100, 0.125
    leaves = [torch.randn(batch, h, seq, dim, generator=g) for h in (heads, kv_heads, kv_heads)]
    sinks = torch.randn(heads, generator=g)
    docs = packed_ids(batch, seq, g)
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in leaves)
    sinks_cuda = sinks.cuda().requires_grad_()
    ctx = PackedContext.for_tokens(torch.zeros(batch, seq, dtype=torch.long, device="cuda"), docs.cuda())
    out = attend(q, k, v, ctx, scale=scale, window_size=window, sink_logits=sinks_cuda)  # auto
    grad_out = torch.randn(out.shape, generator=g)
    (out.float() * grad_out.cuda()).sum().backward()
    ref_inputs = [t.double().requires_grad_() for t in (*leaves, sinks)]
    ref = reference_attention(*ref_inputs[:3], docs, window, ref_inputs[3], scale)
    (ref * grad_out.double()).sum().backward()
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=2e-2, atol=2e-2)
    for got, want in zip((q.grad, k.grad, v.grad, sinks_cuda.grad), ref_inputs):
        torch.testing.assert_close(got.double().cpu(), want.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_flex_on_cuda_in_bf16(monkeypatch):
    """A whole model under bf16 autocast with documents, windows and sinks: auto sends every attention
    layer through flex, and forward and backward run."""
    used = []
    real = flex_module.flex_attend

    def counting(*args, **kwargs):
        used.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr("meshtron.nn.attention_core.flex_attend", counting)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 128, (2, 256), generator=g).cuda()
    docs = packed_ids(2, 256, g).cuda()
    cfg = small_config(softmax_type="learnable", window_size=64, max_position_embeddings=256)
    model = GPTModel(cfg).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens, PackedContext.for_tokens(tokens, docs))
    logits.float().square().mean().backward()
    assert used == [torch.bfloat16] * cfg.pattern.count("*")
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
