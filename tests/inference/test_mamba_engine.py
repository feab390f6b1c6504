"""The engine on hybrid and pure Mamba models, token for token against the full-recompute reference:
continuous batching of decodes (recurrent step) with prefill chunks (chunked scan continuing from the
state slot), preemption (recompute from a zero state), suspend/resume; state slots are given back
with their requests; `MambaInferenceStateConfig` comes from the model; settings that cannot work
are refused in one line; `meshtron generate` runs a hybrid checkpoint."""

from __future__ import annotations

import pytest
import torch
import yaml

from meshtron.config import ConfigError, ModelConfig
from meshtron.inference.mamba_state import MambaInferenceStateConfig
from meshtron.models import GPTModel
from tests.inference.helpers import TOKENIZER, engine, greedy_params, reference_greedy, workload

PATTERNS = {"hybrid": "M*-M-", "mamba": "MMM"}


def mamba_model(kind: str) -> GPTModel:
    torch.manual_seed(0)
    cfg = ModelConfig(layer_pattern=PATTERNS[kind], hidden_size=32, num_attention_heads=4, mamba_head_dim=8,
                      mamba_num_groups=2, mamba_state_dim=6, mamba_chunk_size=8, max_position_embeddings=96,
                      make_vocab_size_divisible_by=1, init_method_std=0.2)
    return GPTModel(cfg, TOKENIZER.vocab_size).eval()


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def case(request):
    model = mamba_model(request.param)
    prompts, max_tokens = workload(10, max_prompt=36, max_output=8)
    return model, prompts, max_tokens, [reference_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]


def run(eng, prompts, max_tokens):
    return eng.generate(prompts, greedy_params(max_tokens))


def test_batched_chunked_and_preempted_equal_reference(case):
    model, prompts, max_tokens, expected = case
    # 24-token budget: prompts up to 36 tokens are prefilled in chunks; 24 blocks of 4: preemptions
    eng = engine(model, block_size=4, num_blocks=24, max_num_seqs=6, max_num_batched_tokens=24)
    outputs = run(eng, prompts, max_tokens)
    assert [o.token_ids for o in outputs] == expected
    assert sum(1 for o in outputs for e in o.events if e.kind.value == "preempted") > 0
    assert eng.scheduler.state_slots.num_free == 6 and eng.kv.num_free_blocks == 24  # all given back
    assert not eng.config.enable_prefix_caching  # a prefix hit would skip tokens the state needs


def test_suspend_resume_gives_the_uninterrupted_outputs(case):
    model, prompts, max_tokens, expected = case
    eng = engine(model, block_size=4, num_blocks=256, max_num_seqs=4)
    for p, m in zip(prompts[:6], greedy_params(max_tokens[:6])):
        eng.add_request(p, m)
    finished = {}
    for _ in range(3):
        finished.update({o.req_id: o for o in eng.step() if o.finished})
    eng.suspend()
    eng.resume()
    while eng.has_unfinished_requests():
        finished.update({o.req_id: o for o in eng.step() if o.finished})
    assert [finished[f"req-{i}"].token_ids for i in range(6)] == expected[:6]


def test_state_config_comes_from_the_model():
    cfg = MambaInferenceStateConfig.from_model(mamba_model("hybrid"))
    # 8 heads of 8 (expand 2 x 32 / 8), B and C 2 groups x 6; conv kernel 4 keeps 3 inputs
    assert cfg.pattern == "M*-M-" and cfg.layer_ids == (0, 3)
    assert cfg.conv_shape == (3, 64 + 2 * 12) and cfg.ssm_shape == (8, 8, 6) and cfg.dtype == torch.float32
    assert cfg.bytes_per_request == 2 * (3 * 88 + 8 * 8 * 6) * 4
    assert MambaInferenceStateConfig.from_model(GPTModel(ModelConfig(num_layers=1), 64)) is None


@pytest.mark.parametrize("options,message", [
    ({"layout": "packed"}, "engine.layout: 'packed' is not allowed for a model with Mamba layers"),
    ({"cuda_graphs": True}, "engine.cuda_graphs: True is not allowed for a model with Mamba layers"),
])
def test_unsupported_engine_settings_are_refused(options, message):
    with pytest.raises(ConfigError) as info:
        engine(mamba_model("hybrid"), **options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_generate_cli_runs_a_hybrid_checkpoint(tmp_path, capsys):
    from meshtron.checkpoint import CheckpointManager
    from meshtron.cli import main
    from meshtron.config.loader import config_to_dict
    from meshtron.config.schema import RunConfig

    model = mamba_model("hybrid")
    cfg = RunConfig(model=model.cfg)
    CheckpointManager(tmp_path / "ck").save(0, model, None, {"step": 0}, yaml.safe_dump(config_to_dict(cfg)))
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "ck"), "--prompt", "def ", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    expected = TOKENIZER.decode(reference_greedy(model, TOKENIZER.encode("def "), 12))
    assert expected in capsys.readouterr().out


@pytest.mark.slow
def test_tp2_leader_follower_equals_single_process(tmp_path):
    """Heads split over two ranks; the follower gets each step's chunks (with their state slots)."""
    from meshtron.checkpoint import CheckpointManager
    from meshtron.config.loader import config_to_dict
    from meshtron.config.schema import RunConfig
    from meshtron.testing.multiprocess import run_ranks

    model = mamba_model("hybrid")
    CheckpointManager(tmp_path / "ck").save(0, model, None, {"step": 0},
                                            yaml.safe_dump(config_to_dict(RunConfig(model=model.cfg))))
    prompts, max_tokens = workload(6, max_prompt=20, max_output=8)
    expected = [reference_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    results = run_ranks("tests.inference.test_tp:leader_follower_rank", 2, timeout_s=240,
                        checkpoint=str(tmp_path / "ck"), prompts=prompts, max_tokens=max_tokens)
    assert results[0] == expected
