"""Rollout generator and evaluation agent: pass@k against hand-computed values of the unbiased
estimator, `evaluate` on a stand-in backend whose answers are scripted, the trainer taking a user's
generator/agent, and the `rl.backend` config path (openai against an in-process stand-in server,
transformers mirroring the trained weights)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import tests.rl.helpers  # noqa: F401  (registers the 'digits' environment)
from meshtron.cli import main
from meshtron.rl.environments import Problem
from meshtron.rl.inference import Generation
from meshtron.rl.rollout import (
    EvaluationAgent,
    GroupedRollouts,
    PassAtKEvaluator,
    RolloutGenerator,
    evaluate,
    pass_at_k,
)
from tests.rl.helpers import TOKENIZER
from tests.rl.test_grpo import TINY_RL, rl_config


def test_pass_at_k_hand_computed():
    # 1 - C(n - c, k) / C(n, k)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(6, 1, 3) == pytest.approx(1 - 10 / 20)
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # every pair of 4 holds a correct one when only 1 is wrong
    assert pass_at_k(4, 4, 4) == 1.0


class Echo:
    """Problem data is the right answer; reward 1 for exactly it."""

    name = "echo"

    def get_dataset(self, split, size, seed):
        return [Problem("echo", f"a{i}") for i in range(size)]

    def get_prompt(self, problem):
        return problem.data + "?"

    def get_reward(self, problem, completion):
        return float(completion == problem.data)


class ScriptedBackend:
    """Greedy answers: right for the prompts in `greedy_right`. Sampled answers: for the prompt's j-th
    sample (in call order), right when j < right_samples[prompt]."""

    def __init__(self, greedy_right: set[str], right_samples: dict[str, int]):
        self.greedy_right, self.right_samples = greedy_right, right_samples
        self.seen: dict[str, int] = {}
        self.seeds: list[int] = []

    def generate(self, prompts, sampling):
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        out = []
        for ids, p in zip(prompts, params):
            answer = TOKENIZER.decode(ids)[:-1]
            if p.temperature == 0:
                text = answer if answer in self.greedy_right else "wrong"
            else:
                j = self.seen[answer] = self.seen.get(answer, -1) + 1
                text = answer if j < self.right_samples[answer] else "nope"
                self.seeds.append(p.seed)
            out.append(Generation(list(ids), TOKENIZER.encode(text), [0.0] * len(text), text, "stop"))
        return out

    def suspend(self):
        pass

    def resume(self):
        pass


def test_evaluate_pass_at_k_on_scripted_answers():
    env = Echo()
    problems = env.get_dataset("eval", 3, 0)
    backend = ScriptedBackend({"a0"}, {"a0": 0, "a1": 2, "a2": 4})
    out = evaluate(backend, env, TOKENIZER, problems, max_tokens=4, num_samples=4, k=2, seed=5)
    # c = 0, 2, 4 of n = 4: pass@2 = (0 + (1 - C(2,2)/C(4,2)) + 1) / 3
    assert out["pass@2"] == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)
    assert out["greedy_success"] == pytest.approx(1 / 3) and out["mean_reward"] == pytest.approx(1 / 3)
    assert len(set(backend.seeds)) == 12  # every sample its own seed
    agent = PassAtKEvaluator(max_tokens=4, num_samples=4, k=2, seed=5)
    assert isinstance(agent, EvaluationAgent) and isinstance(GroupedRollouts(4), RolloutGenerator)
    again = agent.evaluate(ScriptedBackend({"a0"}, {"a0": 0, "a1": 2, "a2": 4}), env, TOKENIZER, problems)
    assert again == out


class FixedAnswers:
    """A user's rollout generator: every completion is '1x' (digits reward 0.5), log probs 0."""

    group_size = 2

    def __init__(self):
        self.calls = 0

    def generate(self, backend, env, tokenizer, problems, sampling, seed, step, first_group=0):
        from meshtron.rl.rollout import Rollout

        self.calls += 1
        out = []
        for i, p in enumerate(problems):
            ids = tokenizer.encode(env.get_prompt(p))
            for j in range(self.group_size):
                out.append(Rollout(p, first_group + i, j, ids, tokenizer.encode("1x"), [0.0, 0.0], "1x",
                                   env.get_reward(p, "1x")))
        return out


class Constant:
    def evaluate(self, backend, env, tokenizer, problems):
        return {"score": 0.25}


def test_trainer_takes_a_user_generator_and_agent(tmp_path):
    from meshtron.rl.trainer import GRPOTrainer

    gen = FixedAnswers()
    trainer = GRPOTrainer(rl_config(tmp_path, **{"train.train_iters": 2, "rl.group_size": 2}), rollouts=gen,
                          evaluator=Constant())
    history = trainer.train()
    assert gen.calls == 2 and [h["reward_mean"] for h in history] == [0.5, 0.5]
    assert trainer.evaluate() == {"score": 0.25}
    with pytest.raises(Exception, match="rl.group_size: 8 differs"):
        GRPOTrainer(rl_config(tmp_path), rollouts=gen)


class StandIn(BaseHTTPRequestHandler):
    """An OpenAI-style /v1/completions that answers '7a' to everything (digits reward 0.5)."""

    bodies: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.bodies.append((self.path, body))
        ids = TOKENIZER.encode("7a") + [TOKENIZER.eod_id]
        answer = {"choices": [{"text": "7a", "finish_reason": "stop",
                               "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                            "token_logprobs": [-0.5] * len(ids)}}]}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # the backend sends 16 requests at once


def test_openai_backend_from_the_config(tmp_path):
    from meshtron.rl.inference import OpenAIBackend
    from meshtron.rl.trainer import GRPOTrainer

    server = Server(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    StandIn.bodies = []
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        trainer = GRPOTrainer(rl_config(tmp_path, **{"train.train_iters": 1, "rl.backend": "openai",
                                                     "rl.openai_base_url": url, "rl.openai_model": "tiny"}))
        assert isinstance(trainer.backend, OpenAIBackend)
        history = trainer.train()
    finally:
        server.shutdown()
    assert history[0]["reward_mean"] == pytest.approx(0.5)
    assert history[0]["completion_tokens_mean"] == 3  # '7', 'a' and the end of document
    rollouts = [b for _, b in StandIn.bodies if b["temperature"] == 1.0]
    assert len(rollouts) == 8 * 8 and len({b["seed"] for b in rollouts}) == 64
    assert all(path == "/v1/completions" and b["model"] == "tiny" for path, b in StandIn.bodies)


def test_backend_config_errors(tmp_path, capsys):
    overrides = [f"--{k}={v}" for k, v in {**TINY_RL, "train.train_iters": "1",
                                            "train.run_dir": str(tmp_path / "r")}.items()]
    assert main(["rl", *overrides, "--rl.backend=openai"]) == 2
    assert "rl.openai_base_url" in capsys.readouterr().err
    assert main(["rl", *overrides, "--rl.openai_base_url=http://127.0.0.1:1/v1"]) == 2
    err = capsys.readouterr().err
    assert "only used with rl.backend=openai" in err and len(err.strip().splitlines()) == 1
    assert main(["rl", *overrides, "--rl.backend=vllm"]) == 2


def test_transformers_backend_mirrors_the_trained_weights(tmp_path):
    pytest.importorskip("transformers")
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.request import SamplingParams
    from meshtron.rl.inference import EngineBackend, MirroredTransformersBackend
    from meshtron.rl.trainer import GRPOTrainer

    trainer = GRPOTrainer(rl_config(tmp_path, **{"rl.backend": "transformers", "model.init_method_std": "0.3"}))
    assert isinstance(trainer.backend, MirroredTransformersBackend)
    engine = EngineBackend(trainer.model, TOKENIZER, EngineConfig(num_blocks=64))
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    def check():
        hf, ours = trainer.backend.generate(prompts, params), engine.generate(prompts, params)
        assert [g.token_ids for g in hf] == [g.token_ids for g in ours]
        assert max(abs(a - b) for x, y in zip(hf, ours) for a, b in zip(x.log_probs, y.log_probs)) <= 1e-4
        return [g.token_ids for g in ours]

    before = check()
    with torch.no_grad():  # an update in place: the mirror must follow it
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    engine.suspend()
    assert check() != before
