"""The rollout backends' log-prob contract: for the same weights and tokens the engine's log probs
equal the trainer's (fp32, <= 1e-5) with and without packing; after an in-place update the engine
answers with the new weights (no stale keys/values or prefix cache); the HTTP, transformers and
coordinator backends agree with the engine."""

from __future__ import annotations

import threading

import pytest
import torch

from meshtron.inference.config import EngineConfig
from meshtron.inference.request import SamplingParams
from meshtron.rl.grpo import forward_log_probs
from meshtron.rl.inference import EngineBackend
from meshtron.rl.packing import TrainSequence, micro_batches, pack_sequences, unpacked_rows
from tests.inference.helpers import reference_greedy
from tests.rl.helpers import TOKENIZER, tiny_model

PAD = TOKENIZER.pad_id


def trainer_log_probs(model, generations, temperature: float, packed: bool) -> list[list[float]]:
    """The trainer's log probs of each completion token, from packed rows or one row per sequence."""
    seqs = [TrainSequence(g.prompt_token_ids + g.token_ids, len(g.prompt_token_ids), 1.0 + i)
            for i, g in enumerate(generations)]
    rows = pack_sequences(seqs, 64, PAD) if packed else unpacked_rows(seqs, PAD)
    out: dict[int, list[float]] = {}
    with torch.no_grad():
        for mb in micro_batches(rows, 4):
            logp = forward_log_probs(model, mb, temperature)[0]
            for r in range(logp.shape[0]):
                w = mb["weights"][r]
                for weight in sorted(set(w[w > 0].tolist())):  # the weight names the sequence
                    out[int(round(weight - 1.0))] = logp[r][w == weight].tolist()
    return [out[i] for i in range(len(generations))]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_log_probs_equal_trainer_log_probs(temperature):
    model = tiny_model()
    backend = EngineBackend(model, TOKENIZER, EngineConfig(block_size=4, num_blocks=256))
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([3, 7, 12, 5, 9, 1])]
    params = [SamplingParams(max_tokens=8 + i, temperature=temperature, seed=i, ignore_eos=True) for i in range(6)]
    gens = backend.generate(prompts, params)
    assert all(len(g.log_probs) == len(g.token_ids) == 8 + i for i, g in enumerate(gens))
    engine = [g.log_probs for g in gens]
    for packed in (False, True):
        trainer = trainer_log_probs(model, gens, temperature, packed)
        worst = max(abs(a - b) for e, t in zip(engine, trainer) for a, b in zip(e, t))
        assert worst <= 1e-5, (packed, worst)
    # the packed rows really hold several sequences (otherwise the check above proves nothing new)
    seqs = [TrainSequence(g.prompt_token_ids + g.token_ids, len(g.prompt_token_ids), 1.0) for g in gens]
    assert len(pack_sequences(seqs, 64, PAD)) < len(gens)


def test_no_stale_weights_after_an_update():
    model = tiny_model()
    backend = EngineBackend(model, TOKENIZER, EngineConfig(block_size=4, num_blocks=256, enable_prefix_caching=True))
    prompt = list(range(40, 60))  # five full blocks: cached as a prefix after the first request
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    before = backend.generate([prompt], greedy)[0]
    assert before.token_ids == reference_greedy(model, prompt, 6)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.train()
    model(torch.tensor([prompt])).logsumexp(-1).mean().backward()  # an update that changes every layer
    optimizer.step()
    # without a reset the engine would reuse the prompt's cached keys/values of the old weights:
    stale = backend.generate([prompt], greedy)[0]
    fresh_lp = trainer_log_probs(model, [stale], 1.0, packed=False)[0]
    assert max(abs(a - b) for a, b in zip(stale.log_probs, fresh_lp)) > 1e-3  # the test can tell stale from fresh
    backend.suspend()  # what the RL loop does before training
    after = backend.generate([prompt], greedy)[0]
    assert after.token_ids == reference_greedy(model, prompt, 6)
    assert after.token_ids != before.token_ids
    fresh_lp = trainer_log_probs(model, [after], 1.0, packed=False)[0]
    assert max(abs(a - b) for a, b in zip(after.log_probs, fresh_lp)) <= 1e-5
    assert model.training  # the backend leaves the model's mode as it found it


def test_engine_shares_the_model_parameters():
    model = tiny_model()
    backend = EngineBackend(model, TOKENIZER, EngineConfig(block_size=4, num_blocks=64))
    assert backend.engine.runner.model is model
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in backend.engine.runner.model.parameters()} == ptrs


def test_transformers_backend_log_probs():
    transformers = pytest.importorskip("transformers")
    from meshtron.rl.inference import TransformersBackend

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    backend = TransformersBackend(hf, TOKENIZER)
    gens = backend.generate([[5, 6, 7], [9, 10]], SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True))
    for g in gens:
        ids = torch.tensor([g.prompt_token_ids + g.token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(g.prompt_token_ids) - 1:-1].float() / 0.8
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(g.log_probs), expected, atol=1e-5)


def test_coordinator_backend_matches_the_engine():
    from meshtron.inference.coordinator import Coordinator
    from meshtron.inference.coordinator_worker import EngineHandler, EngineWorker
    from meshtron.inference.engine import LLMEngine
    from meshtron.rl.inference import CoordinatorBackend

    coordinator = Coordinator().start()
    model = tiny_model()
    worker = EngineWorker(coordinator.address, EngineHandler(LLMEngine(model, TOKENIZER, EngineConfig(num_blocks=64))),
                          "w0", heartbeat_interval_s=0.1)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    backend = CoordinatorBackend(coordinator.address, timeout_s=60)
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7]]
        params = SamplingParams(max_tokens=5, temperature=0.0)
        remote = backend.generate(prompts, params)
        local = EngineBackend(tiny_model(), TOKENIZER, EngineConfig(num_blocks=64)).generate(prompts, params)
        assert [g.token_ids for g in remote] == [g.token_ids for g in local]
        assert max(abs(a - b) for r, q in zip(remote, local) for a, b in zip(r.log_probs, q.log_probs)) <= 1e-5
        backend.suspend()
        backend.resume()
        assert backend.client.control("STOP")["num_workers"] == 0
    finally:
        thread.join(timeout=10)
        backend.client.close()
        coordinator.close()


def test_openai_backend_against_meshtron_serve(tmp_path):
    import os
    import subprocess
    import sys

    from meshtron.inference.engine import LLMEngine
    from meshtron.rl.inference import OpenAIBackend
    from meshtron.testing.multiprocess import free_port
    from tests.inference.helpers import save_tiny_checkpoint
    from tests.inference.test_server import wait_ready

    ckpt = save_tiny_checkpoint(tmp_path / "tiny-run")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", "serve", "--checkpoint", ckpt, "--port", str(port),
                             "--num-blocks", "64", "--log-level", "warning"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        prompts = [[1, 2, 3], [200, 201, 255, 7]]  # byte ids > 127 do not survive decoding as text
        params = [SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=6, temperature=0.5, seed=4)]
        remote = OpenAIBackend(url, tokenizer=TOKENIZER).generate(prompts, params)
        local = EngineBackend(LLMEngine.from_checkpoint(ckpt, EngineConfig(num_blocks=64)).runner.model, TOKENIZER,
                              EngineConfig(num_blocks=64)).generate(prompts, params)
        for r, q in zip(remote, local):
            assert r.token_ids == q.token_ids and r.prompt_token_ids == q.prompt_token_ids
            assert max(abs(a - b) for a, b in zip(r.log_probs, q.log_probs)) <= 1e-5
    finally:
        proc.kill()
        proc.wait()
