"""engine.decode_attention flex: one FlexAttention call per layer over decodes and prefill chunks,
reading the paged cache through the block tables. The kernel against a float64 loop over the block
tables (shuffled physical blocks, shared prefix blocks, GQA, windows, sinks, MLA's value width); its
BlockMask lists against the keys each tile's queries may see; the engine with flex against gather,
the full-recompute reference and transformers' greedy generate (chunked prefill, preemption); and no
index op reads the cache on the flex path (the gather path's does, so the count can fail)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import meshtron.inference.flex_paged_attention as flex
from meshtron.inference.flex_paged_attention import FlexPagedPlan, PagedSequence, flex_paged_attention
from meshtron.inference.request import SamplingParams
from tests.inference.helpers import engine, greedy_params, reference_greedy, tiny_model, workload

CPU = torch.device("cpu")


def random_step(num_blocks: int, bs: int, shapes: list[tuple[int, int]], shared_prefix_blocks: int = 0,
                seed: int = 0) -> list[PagedSequence]:
    """Sequences (start_pos, num_tokens) with block tables drawn from shuffled physical blocks; the first
    two share their first `shared_prefix_blocks` blocks (a prefix-cache hit)."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    out = []
    for i, (start, n) in enumerate(shapes):
        held = -(-(start + n) // bs)
        table = out[0].block_ids[:shared_prefix_blocks] if i == 1 and shared_prefix_blocks else []
        table = list(table) + [free.pop() for _ in range(held - len(table))]
        out.append(PagedSequence(table + [free.pop()], start, n))  # one block allocated past the end
    return out


def naive(q, k_cache, v_cache, seqs, bs, window, scale, sinks=None) -> torch.Tensor:
    """float64 loop: each query, each head, the keys of its positions read slot by slot through its table."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    k_slots, v_slots = k_cache.reshape(-1, kv_heads, k_cache.shape[-1]), v_cache.reshape(-1, kv_heads, v_cache.shape[-1])
    out = torch.zeros(1, heads, q.shape[2], v_cache.shape[-1], dtype=torch.float64)
    i = 0
    for s in seqs:
        for p in range(s.start_pos, s.start_pos + s.num_tokens):
            slots = [s.block_ids[x // bs] * bs + x % bs for x in range(p + 1) if window is None or p - x < window]
            for h in range(heads):
                kv = h // (heads // kv_heads)
                logits = (k_slots[slots, kv].double() @ q[0, h, i].double()) * scale
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h:h + 1].double()])
                probs = logits.softmax(0)[:len(slots)]
                out[0, h, i] = probs @ v_slots[slots, kv].double()
            i += 1
    return out


SHAPES = [(9, 1), (0, 11), (23, 1), (5, 6), (40, 1), (0, 1), (17, 1)]  # decodes, a prompt, a later chunk


@pytest.mark.parametrize("window", [None, 3, 9])
@pytest.mark.parametrize("heads,kv_heads,dv", [(4, 2, 8), (4, 1, 8), (2, 2, 5)])
def test_kernel_equals_a_loop_over_the_block_tables(window, heads, kv_heads, dv):
    torch.manual_seed(0)
    bs, num_blocks, dk = 4, 48, 8
    seqs = random_step(num_blocks, bs, SHAPES, shared_prefix_blocks=2)
    k_cache = torch.randn(num_blocks + 1, bs, kv_heads, dk, dtype=torch.float64)
    v_cache = torch.randn(num_blocks + 1, bs, kv_heads, dv, dtype=torch.float64)
    q = torch.randn(1, heads, sum(s.num_tokens for s in seqs), dk, dtype=torch.float64)
    plan = FlexPagedPlan.build(seqs, bs, num_blocks + 1, CPU)
    got = flex_paged_attention(q, k_cache, v_cache, plan, window, 0.3)
    torch.testing.assert_close(got, naive(q, k_cache, v_cache, seqs, bs, window, 0.3), rtol=1e-10, atol=1e-10)
    sinks = torch.randn(heads)
    got = flex_paged_attention(q, k_cache, v_cache, plan, window, 0.3, sink_logits=sinks)
    torch.testing.assert_close(got, naive(q, k_cache, v_cache, seqs, bs, window, 0.3, sinks), rtol=1e-10, atol=1e-10)


def seen(seqs, bs, window) -> list[set[int]]:
    """Per packed query, the cache slots it attends (the loop's view)."""
    out = []
    for s in seqs:
        for p in range(s.start_pos, s.start_pos + s.num_tokens):
            out.append({s.block_ids[x // bs] * bs + x % bs for x in range(p + 1) if window is None or p - x < window})
    return out


@pytest.mark.parametrize("window", [None, 5, 40])
def test_block_lists_cover_every_key_and_full_blocks_are_whole(window):
    """The CUDA kernel reads only the listed blocks and skips mask_mod on full ones (the CPU reference
    reads every slot, so the lists are checked here): every attended slot lies in a listed block of its
    query's tile, every listed block holds one, and every slot of a full block is attended by every query."""
    bs, num_blocks = 4, 200
    shapes = [(0, 260), (3, 1), (100, 140), (7, 1), (60, 1), (0, 3)]  # 406 queries: four tiles of 128
    seqs = random_step(num_blocks, bs, shapes, shared_prefix_blocks=1, seed=3)
    plan = FlexPagedPlan.build(seqs, bs, num_blocks + 1, CPU)
    kv_num, kv_idx, full_num, full_idx = plan.mask_tensors(window)
    slots = seen(seqs, bs, window)
    tiles = -(-len(slots) // flex.Q_BLOCK_SIZE)
    assert kv_num.shape == (1, 1, tiles) and full_num.shape == (1, 1, tiles)
    num_full = 0
    for t in range(tiles):
        queries = slots[t * flex.Q_BLOCK_SIZE:(t + 1) * flex.Q_BLOCK_SIZE]
        partial = set(kv_idx[0, 0, t, :kv_num[0, 0, t]].tolist())
        full = set(full_idx[0, 0, t, :full_num[0, 0, t]].tolist())
        assert not partial & full
        needed = {slot // bs for q in queries for slot in q}
        assert partial | full == needed, t
        for block in full:
            assert all(set(range(block * bs, block * bs + bs)) <= q for q in queries), (t, block)
        num_full += len(full)
    assert num_full > 0 or window is not None  # without a window the long prompt's tiles have whole blocks


def test_plan_maps_cache_blocks_back_to_positions():
    bs = 4
    seqs = [PagedSequence([5, 2, 7], 9, 1), PagedSequence([5, 3], 0, 6)]  # block 5 shared, 7 past the first's end?
    plan = FlexPagedPlan.build(seqs, bs, 9, CPU)
    assert plan.query_seq.tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert plan.query_pos.tolist() == [9, 0, 1, 2, 3, 4, 5]
    assert plan.block_logical.tolist() == [[-1, -1, 1, -1, -1, 0, -1, 2, -1], [-1, -1, -1, 1, -1, 0, -1, -1, -1]]


def test_query_tile_fits_flex_decoding():
    """Short steps: one tile at least next_pow2(T * group) wide (flex's decoding kernel's rows); long: 128."""
    assert [flex._query_tile(t, g) for t, g in [(1, 1), (5, 4), (32, 4), (33, 4), (100, 8), (127, 1), (128, 8)]] == \
        [128, 128, 128, 256, 1024, 128, 128]


def test_selection_on_cuda_and_the_block_size_rule(monkeypatch):
    """Decided before any op, so a CPU machine can check what a CUDA engine would pick."""
    from meshtron.config.fields import ConfigError
    from meshtron.inference import decode_attention as selection
    from meshtron.inference.config import EngineConfig

    monkeypatch.setattr(selection, "_noticed", set())
    model, cuda = tiny_model(), torch.device("cuda")
    choice, fn = selection.select_decode_attention(model, EngineConfig(), cuda)
    assert choice == "flex" and fn.compiled
    assert selection.select_decode_attention(model, EngineConfig(block_size=8), cuda) == ("gather", None)
    with pytest.raises(ConfigError, match=r"engine.decode_attention: 'flex' is not available: flex's CUDA kernels "
                                          r"need engine.block_size to be a multiple of 16 \(it is 8\)"):
        selection.select_decode_attention(model, EngineConfig(block_size=8, decode_attention="flex"), cuda)
    choice, fn = selection.select_decode_attention(model, EngineConfig(block_size=4, decode_attention="flex"), CPU)
    assert choice == "flex" and not fn.compiled  # the eager reference on a CPU, any block size
    assert selection.select_decode_attention(model, EngineConfig(), CPU)[0] in ("native", "gather")  # CPU unchanged
    # the CUDA kernels' key tile divides the cache block (BlockMask key block): 16, 48 -> 16; 32 -> 32; 64, 256 -> 64
    assert [flex.cuda_kernel_options(b)["BLOCK_N"] for b in (16, 48, 32, 64, 256)] == [16, 16, 32, 64, 64]


# --- the engine -----------------------------------------------------------------------------------


def run(eng, prompts, params):
    return [o.token_ids for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("kind", ["gqa-rope", "window-rope", "window-sinks-learned-pos", "mla"])
def test_engine_flex_equals_gather_and_the_reference_with_chunked_prefill_and_preemption(kind):
    model = tiny_model(kind)
    prompts, max_tokens = workload(num_requests=8, max_prompt=20, max_output=8, seed=2)
    expected = [reference_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    options = dict(block_size=4, num_blocks=10, max_num_seqs=8, max_num_batched_tokens=9)  # chunks and preemption
    gather = engine(model, decode_attention="gather", **options)
    assert run(gather, prompts, greedy_params(max_tokens)) == expected
    fast = engine(model, decode_attention="flex", **options)
    assert fast.runner.decode_attention_choice == "flex"
    outputs = fast.generate(prompts, greedy_params(max_tokens))
    assert [o.token_ids for o in outputs] == expected
    assert sum(1 for o in outputs for e in o.events if e.kind.value == "preempted") > 0
    assert fast.kv.num_free_blocks == 10


def test_engine_flex_equals_transformers_greedy_generate(tmp_path):
    """A Mistral (grouped-query heads, sliding window) built by transformers, converted, served with flex."""
    from meshtron.models.hf import hf_to_meshtron
    from tests.models.hf.conftest import load_hf, transformers
    from tests.models.hf.test_families import load_meshtron

    config = transformers.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        initializer_range=0.2, sliding_window=6)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    hf.generation_config.eos_token_id = None
    model = load_meshtron(hf_to_meshtron(tmp_path / "hf", tmp_path / "ckpt"))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (13, 3, 9, 17)]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):]
                    .tolist() for p in prompts]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * len(prompts)
    eng = engine(model, block_size=4, num_blocks=32, max_num_batched_tokens=8, decode_attention="flex")
    assert run(eng, prompts, params) == expected


class CacheIndexReads(TorchDispatchMode):
    """Counts index ops (index_select, index, gather, take, embedding) whose input shares storage with
    a KV cache tensor, i.e. reads of keys/values through an index; writes (index_copy_) are not reads."""

    READS = {"index_select", "index", "gather", "take", "embedding"}

    def __init__(self, cache):
        super().__init__()
        self.cache, self.count = cache, 0

    def _cache_storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for pair in self.cache.layers.values() for t in pair}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in self.READS:
            storages = self._cache_storages()
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            self.count += any(t.untyped_storage().data_ptr() in storages for t in tensors)
        return func(*args, **kwargs)


def test_flex_reads_the_cache_without_gathering(monkeypatch):
    """On the flex path no op reads keys/values through an index outside the kernel, and the kernel gets
    views of the cache tensors themselves (every slot: nothing copied first). The same counter sees the
    gather path's index_select, so it is not blind."""
    model = tiny_model("gqa-rope")
    prompts, max_tokens = workload(num_requests=4, max_prompt=12, max_output=4, seed=5)
    kernel_inputs = []
    real = flex.flex_attention

    def recording(q, k, v, **kwargs):
        kernel_inputs.append((k, v))
        with _disable_current_modes():  # flex's own CPU reference is not the engine's code
            return real(q, k, v, **kwargs)

    monkeypatch.setattr(flex, "flex_attention", recording)
    counts = {}
    for choice in ("gather", "flex"):
        eng = engine(model, block_size=4, num_blocks=32, max_num_batched_tokens=10, decode_attention=choice)
        eng.generate(prompts[:1], greedy_params([1]))  # allocates the cache tensors
        with CacheIndexReads(eng.runner.cache) as mode:
            eng.generate(prompts, greedy_params(max_tokens))
        counts[choice] = mode.count
        cache = eng.runner.cache
    assert counts["gather"] > 0
    assert counts["flex"] == 0
    assert kernel_inputs
    storages = {t.untyped_storage().data_ptr() for pair in cache.layers.values() for t in pair}
    for k, v in kernel_inputs[-4:]:
        assert k.untyped_storage().data_ptr() in storages and v.untyped_storage().data_ptr() in storages
        assert k.shape[2] == v.shape[2] == (32 + 1) * 4  # every slot of the cache, as a view


@pytest.mark.slow
def test_compiled_kernel_on_cpu_equals_the_loop(monkeypatch):
    """flex's compiled CPU kernel reads only the listed blocks, so this checks the lists through a real
    block-sparse kernel (static shapes: inductor's CPU template fails to build with dynamic ones)."""
    torch.manual_seed(0)
    bs, num_blocks, heads, kv_heads, d = 16, 40, 4, 2, 16
    seqs = random_step(num_blocks, bs, [(5, 1), (0, 140), (13, 1), (20, 30), (70, 1)], shared_prefix_blocks=1)
    k_cache, v_cache = (torch.randn(num_blocks + 1, bs, kv_heads, d) for _ in range(2))
    q = torch.randn(1, heads, sum(s.num_tokens for s in seqs), d)
    monkeypatch.setattr(flex, "_compiled", torch.compile(flex._flex_call, fullgraph=True, dynamic=False))
    for window in (None, 20):
        plan = FlexPagedPlan.build(seqs, bs, num_blocks + 1, CPU)
        got = flex_paged_attention(q, k_cache, v_cache, plan, window, 0.25, compiled=True)
        torch.testing.assert_close(got.double(), naive(q, k_cache, v_cache, seqs, bs, window, 0.25),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_on_cuda(dtype):
    """The compiled Triton kernels (flex decoding for short steps, flex attention for long ones)."""
    torch.manual_seed(0)
    bs, num_blocks, heads, kv_heads, d = 16, 64, 8, 2, 64
    cuda = torch.device("cuda")
    for shapes in ([(5, 1), (40, 1), (200, 1)], [(5, 1), (0, 140), (13, 1), (20, 30), (70, 1)]):
        seqs = random_step(num_blocks, bs, shapes, shared_prefix_blocks=1)
        k_cache, v_cache = (torch.randn(num_blocks + 1, bs, kv_heads, d, device=cuda, dtype=dtype) for _ in range(2))
        q = torch.randn(1, heads, sum(s.num_tokens for s in seqs), d, device=cuda, dtype=dtype)
        for window in (None, 20):
            plan = FlexPagedPlan.build(seqs, bs, num_blocks + 1, cuda)
            got = flex_paged_attention(q, k_cache, v_cache, plan, window, 0.125, compiled=True)
            expected = naive(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqs, bs, window, 0.125)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
            torch.testing.assert_close(got.cpu().double(), expected, rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_flex_on_cuda_and_matches_gather():
    model = tiny_model("window-rope").cuda()
    prompts, max_tokens = workload(num_requests=8, max_prompt=20, max_output=8, seed=2)
    options = dict(block_size=16, num_blocks=64, max_num_batched_tokens=16, device="cuda", dtype="float32")
    fast = engine(model, **options)
    assert fast.runner.decode_attention_choice == "flex"
    gather = engine(model, decode_attention="gather", **options)
    assert run(fast, prompts, greedy_params(max_tokens)) == run(gather, prompts, greedy_params(max_tokens))
