"""Speculative decoding (inference/speculative.py): greedy output equals the full-recompute reference
and the plain engine under batching, chunked prefill, preemption and prefix caching; sampled output
follows the target's exact distribution (enumerated by hand); acceptance counts against closed forms."""

from __future__ import annotations

import itertools

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.config.fields import ConfigError
from meshtron.inference import speculative
from meshtron.inference.config import EngineConfig
from meshtron.inference.engine import LLMEngine
from meshtron.inference.metrics import ServerMetrics
from meshtron.inference.request import EventType, SamplingParams
from meshtron.models import GPTModel
from tests.inference.helpers import TOKENIZER, greedy_params, reference_greedy, tiny_model, workload


def mtp_model(seed: int = 0, vocab: int = TOKENIZER.vocab_size, max_len: int = 96, **extra) -> GPTModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(num_layers=2, hidden_size=32, max_position_embeddings=max_len, make_vocab_size_divisible_by=1,
                      init_method_std=0.2, num_attention_heads=4, num_query_groups=2, position_embedding_type="rope",
                      mtp_num_layers=1, **extra)
    return GPTModel(cfg, vocab).eval()


def perturbed(model: GPTModel, scale: float, seed: int = 5) -> GPTModel:
    """A copy of `model` with noise on every weight: a draft that agrees with it often, not always."""
    draft = mtp_model(vocab=model.vocab_size, max_len=model.cfg.max_position_embeddings)
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return draft


def spec_engine(model, method: str, draft=None, k: int = 3, **options) -> LLMEngine:
    cfg = EngineConfig(speculative_method=method, num_speculative_tokens=k, **options)
    return LLMEngine(model, TOKENIZER, cfg, draft_model=draft)


MODEL = mtp_model()
DRAFTS = {"self": MODEL, "near": perturbed(MODEL, 0.05), "random": tiny_model(seed=3)}


@pytest.mark.parametrize("method,draft", [("mtp", None), ("draft", "near"), ("draft", "random"), ("draft", "self")])
def test_greedy_equals_reference_under_continuous_batching(method, draft):
    prompts, max_tokens = workload(10, max_output=16)
    engine = spec_engine(MODEL, method, DRAFTS.get(draft), max_num_seqs=4)
    outs = engine.generate(prompts, greedy_params(max_tokens))
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == reference_greedy(MODEL, prompt, m)
    stats = engine.stats()["speculative"]
    assert stats["num_draft_tokens"] > 0
    if draft == "near":  # both paths ran: some drafts accepted, some rejected
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_greedy_with_chunked_prefill_preemption_and_prefix_caching():
    """A tiny pool (preemptions), a small step budget (chunked prefills, drafts deferred) and shared
    prefixes (prefix-cache hits): the same tokens as the plain engine and the reference."""
    prompts, max_tokens = workload(12, max_output=20, shared_prefix=12)
    options = dict(block_size=4, num_blocks=22, max_num_batched_tokens=10, max_num_seqs=6)
    spec = spec_engine(MODEL, "draft", DRAFTS["near"], k=3, **options)
    outs = spec.generate(prompts, greedy_params(max_tokens))
    plain = LLMEngine(MODEL, TOKENIZER, EngineConfig(**options)).generate(prompts, greedy_params(max_tokens))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == reference_greedy(MODEL, prompt, m)
    assert any(e.kind == EventType.PREEMPTED for o in outs for e in o.events)
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert spec.kv.num_free_blocks == 22  # every block back, rejected drafts' included


def test_mtp_greedy_with_preemption_and_prefix_caching():
    prompts, max_tokens = workload(10, max_output=16, shared_prefix=8)
    options = dict(block_size=4, num_blocks=20, max_num_batched_tokens=9, max_num_seqs=5)
    outs = spec_engine(MODEL, "mtp", k=2, **options).generate(prompts, greedy_params(max_tokens))
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == reference_greedy(MODEL, prompt, m)


def test_draft_equal_to_target_accepts_everything():
    """Closed form: every draft accepted, so after the prefill's token each forward gives
    min(k + 1, tokens left) tokens: 1 + ceil((m - 1) / (k + 1)) forwards for m tokens."""
    k, m = 3, 14
    prompts = [[5, 6, 7], [9] * 11]
    for params in (SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=m, temperature=0.8, top_k=50, seed=7, ignore_eos=True)):
        engine = spec_engine(MODEL, "draft", MODEL, k=k)
        outs = engine.generate(prompts, [params] * 2)
        for out in outs:
            assert len(out.token_ids) == m
            assert out.num_sampling_steps == 1 + -(-(m - 1) // (k + 1))
            assert out.num_draft_tokens == out.num_accepted_tokens == m - out.num_sampling_steps
            assert out.acceptance_rate == 1.0
        assert engine.stats()["speculative"]["acceptance_rate"] == 1.0


def test_stop_string_and_stop_token_inside_an_accepted_run():
    """All drafts accepted (draft == target): a stop inside a run of accepted tokens ends the output
    exactly where the plain engine ends it."""
    prompt = [3, 1, 4, 1, 5]
    ref = reference_greedy(MODEL, prompt, 20)
    text = TOKENIZER.decode(ref)
    stop_string = text[7:9]
    cases = [SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(ref[6],)),
             SamplingParams(max_tokens=20, temperature=0, stop=(stop_string,))]
    for params in cases:
        plain = LLMEngine(MODEL, TOKENIZER).generate([prompt], [params])[0]
        out = spec_engine(MODEL, "draft", MODEL, k=4).generate([prompt], [params])[0]
        assert (out.token_ids, out.text, out.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
        assert len(out.token_ids) < 20


def test_log_probs_match_the_plain_engine():
    prompts, max_tokens = workload(4, max_output=10)
    params = [SamplingParams(max_tokens=m, temperature=0, return_log_probs=True, top_log_probs=2) for m in max_tokens]
    plain = LLMEngine(MODEL, TOKENIZER).generate(prompts, params)
    spec = spec_engine(MODEL, "draft", DRAFTS["near"]).generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and len(b.log_probs) == len(b.token_ids)
        for x, y in zip(a.log_probs, b.log_probs):
            assert x.token_id == y.token_id and x.log_prob == pytest.approx(y.log_prob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_seeded_sampling_does_not_depend_on_the_batch():
    prompts, max_tokens = workload(3, max_output=12)
    params = [SamplingParams(max_tokens=m, temperature=0.9, top_p=0.9, seed=100 + i) for i, m in enumerate(max_tokens)]
    together = spec_engine(MODEL, "mtp", k=2).generate(prompts, params)
    alone = [spec_engine(MODEL, "mtp", k=2).generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


# ---- the output distribution ----------------------------------------------------------------------

VOCAB, STEPS, TEMPERATURE, TOP_K = 4, 3, 0.9, 3


def exact_sequence_distribution(model: GPTModel, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(t_1 t_2 t_3 | prompt) by enumeration, each step softmax(logits / T) over the top-k, by hand."""
    def next_probs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, -1].double() / TEMPERATURE
        kth = logits.sort(descending=True).values[TOP_K - 1]
        return torch.where(logits >= kth, logits, torch.tensor(float("-inf"), dtype=logits.dtype)).softmax(-1)

    out = {}
    for seq in itertools.product(range(VOCAB), repeat=STEPS):
        prob, ids = 1.0, list(prompt)
        for t in seq:
            prob *= float(next_probs(ids)[t])
            ids.append(t)
        out[seq] = prob
    return out


def chi_square(model, draft, prompt, num_samples: int) -> tuple[float, int, int]:
    """(chi-square statistic of speculative samples against the exact distribution, degrees of freedom,
    samples the target gives probability 0)."""
    expected = exact_sequence_distribution(model, prompt)
    engine = spec_engine(model, "draft", draft, k=2, max_num_seqs=64)
    params = [SamplingParams(max_tokens=STEPS, temperature=TEMPERATURE, top_k=TOP_K, seed=s) for s in range(num_samples)]
    counts = dict.fromkeys(expected, 0)
    for out in engine.generate([prompt] * num_samples, params):
        counts[tuple(out.token_ids)] += 1
    cells = [s for s, p in expected.items() if p > 0]
    stat = sum((counts[s] - num_samples * expected[s]) ** 2 / (num_samples * expected[s]) for s in cells)
    assert engine.stats()["speculative"]["num_draft_tokens"] > 0
    return stat, len(cells) - 1, sum(counts[s] for s in expected if expected[s] == 0)


def tiny_vocab_pair() -> tuple[GPTModel, GPTModel]:
    target = mtp_model(seed=1, vocab=VOCAB, max_len=16)
    draft = mtp_model(seed=2, vocab=VOCAB, max_len=16)  # deliberately different
    with torch.no_grad():
        draft.output.weight.mul_(3.0) if draft.output is not None else draft.embedding.weight.mul_(3.0)
    return target, draft


# chi-square critical value at p = 0.001 for 26 degrees of freedom (3^3 sequences - 1): 54.05
CRITICAL = {26: 54.05}


@pytest.mark.slow
def test_sampled_sequences_follow_the_target_distribution():
    target, draft = tiny_vocab_pair()
    stat, dof, impossible = chi_square(target, draft, [1, 2, 3], num_samples=3000)
    assert impossible == 0 and stat < CRITICAL[dof]


def test_sampled_sequences_follow_the_target_distribution_small():
    """The default-suite representative of the test above (fewer samples, same bound)."""
    target, draft = tiny_vocab_pair()
    stat, dof, impossible = chi_square(target, draft, [1, 2, 3], num_samples=800)
    assert impossible == 0 and stat < CRITICAL[dof]


def test_a_broken_acceptance_rule_fails_the_distribution_test(monkeypatch):
    """The same test catches a rule that accepts every draft (the draft's distribution leaks out)."""
    monkeypatch.setattr(speculative, "accept_drafts", lambda p, q, draft_ids, uniforms: len(draft_ids))
    target, draft = tiny_vocab_pair()
    stat, dof, impossible = chi_square(target, draft, [1, 2, 3], num_samples=800)
    assert impossible > 0 or stat > CRITICAL[dof]


# ---- refusals and stats -----------------------------------------------------------------------------

def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match="mtp_num_layers"):
        spec_engine(tiny_model(), "mtp")
    with pytest.raises(ConfigError, match="vocabulary"):
        spec_engine(MODEL, "draft", mtp_model(vocab=100))
    with pytest.raises(ConfigError, match="speculative_model"):
        spec_engine(MODEL, "draft", None)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        EngineConfig(speculative_method="mtp", cuda_graphs=True).validate()
    torch.manual_seed(0)
    hybrid = GPTModel(ModelConfig(layer_pattern="M*-", hidden_size=32, num_attention_heads=4, mamba_head_dim=8,
                                  mamba_num_groups=2, mamba_state_dim=6, mamba_chunk_size=8, max_position_embeddings=64,
                                  make_vocab_size_divisible_by=1, mtp_num_layers=1), TOKENIZER.vocab_size)
    with pytest.raises(ConfigError, match="Mamba"):
        spec_engine(hybrid, "mtp")


def test_metrics_count_drafts_and_acceptance():
    out = spec_engine(MODEL, "draft", MODEL, k=2).generate([[1, 2, 3]], [SamplingParams(max_tokens=7, temperature=0,
                                                                                         ignore_eos=True)])[0]
    metrics = ServerMetrics()
    metrics.finished_request(out, count_prompt=True)
    text = metrics.render(None).decode()
    assert f"meshtron_spec_draft_tokens_total {float(out.num_draft_tokens)}" in text
    assert f"meshtron_spec_accepted_tokens_total {float(out.num_draft_tokens)}" in text  # all accepted
    assert out.num_sampling_steps == 1 + -(-(7 - 1) // 3)
    assert "meshtron_spec_tokens_per_step_count 1.0" in text


def test_suspend_resume_keeps_the_outputs():
    """Suspend mid-run (caches freed, drafts kept with their requests), resume: the same tokens as an
    uninterrupted speculative run, seeded sampling included."""
    prompts, max_tokens = workload(4, max_output=12)
    params = greedy_params(max_tokens)
    params[0] = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    expected = spec_engine(MODEL, "draft", DRAFTS["near"]).generate(prompts, params)
    eng = spec_engine(MODEL, "draft", DRAFTS["near"])
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    finished = {}
    for _ in range(4):
        finished.update({o.req_id: o for o in eng.step() if o.finished})
    eng.suspend()
    assert eng.runner.speculative.drafter.cache.num_bytes == 0
    eng.resume()
    while eng.has_unfinished_requests():
        finished.update({o.req_id: o for o in eng.step() if o.finished})
    assert [finished[i].token_ids for i in ids] == [o.token_ids for o in expected]


def test_draft_model_from_its_checkpoint(tmp_path):
    from tests.inference.helpers import save_tiny_checkpoint

    target = save_tiny_checkpoint(tmp_path / "target")
    cfg = EngineConfig(speculative_method="draft", speculative_model=target, num_speculative_tokens=2)
    engine = LLMEngine.from_checkpoint(target, cfg)
    out = engine.generate([[7, 8, 9]], [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)])[0]
    assert out.token_ids == reference_greedy(engine.runner.model, [7, 8, 9], 9)
    assert out.acceptance_rate == 1.0  # the draft is the same checkpoint
