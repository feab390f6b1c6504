"""GRPO under tensor parallelism (2 gloo ranks, tp=2) against the single process: the TP leader's
engine samples the same rollouts from the sharded model, the vocabulary-parallel log probs and
entropy give the same loss, and the first optimizer step sees the same gradients (gathered)."""

from __future__ import annotations

import pytest

from tests.rl.test_grpo import TINY_RL

TP_RL = {**TINY_RL, "model.make_vocab_size_divisible_by": "2", "model.tie_word_embeddings": "false",
         "rl.kl_beta": "0.05", "rl.entropy_coef": "0.01", "rl.updates_per_step": "1"}


@pytest.mark.slow
def test_tensor_parallel_grpo_step_matches_the_single_process(tmp_path):
    from meshtron.testing.multiprocess import run_ranks
    from tests.rl.helpers import grpo_step_gradients

    single, grads = grpo_step_gradients(0, 1, {**TP_RL, "train.run_dir": str(tmp_path / "single")}, steps=2)
    ranks = run_ranks("tests.rl.helpers:grpo_step_gradients", 2, timeout_s=300, steps=2,
                      overrides={**TP_RL, "parallel.tp": "2", "train.run_dir": str(tmp_path / "tp")})
    for history, tp_grads in ranks:
        first = history[0]
        assert first["reward_mean"] == single[0]["reward_mean"]  # the same rollouts
        assert first["rollout_tokens"] == single[0]["rollout_tokens"]
        for key in ("loss", "entropy", "grad_norm", "ratio_mean"):
            assert first[key] == pytest.approx(single[0][key], abs=1e-5), key
        assert first["logprob_gap"] < 1e-5  # the sharded engine's log probs equal the sharded trainer's
        assert set(tp_grads) == set(grads)
        worst = max(float((grads[n] - tp_grads[n]).abs().max()) for n in grads)
        assert worst <= 1e-5, worst
        # after an Adam step the two runs differ by Adam-amplified rounding only (PLATFORM.md)
        assert history[1]["kl"] > 0 and history[1]["kl"] == pytest.approx(single[1]["kl"], rel=0.05)
    timings = ("rollout_s", "train_s", "generation_share")
    for a, b in zip(ranks[0][0], ranks[1][0]):  # both TP ranks report the same numbers
        assert {k: v for k, v in a.items() if k not in timings} == {k: v for k, v in b.items() if k not in timings}


def test_unsupported_layouts_are_refused(tmp_path):
    from meshtron.config import ConfigError, load_config
    from meshtron.rl.trainer import GRPOTrainer

    cfg = load_config(overrides={**TP_RL, "train.run_dir": str(tmp_path), "parallel.pp": "2",
                                 "rl.backend": "openai", "rl.openai_base_url": "http://127.0.0.1:1/v1"}, world_size=2)
    with pytest.raises(ConfigError, match="rl.backend: openai is not allowed with parallel.pp=2"):
        GRPOTrainer(cfg)
    cfg = load_config(overrides={**TP_RL, "train.run_dir": str(tmp_path), "parallel.tp": "2",
                                 "rl.backend": "openai", "rl.openai_base_url": "http://127.0.0.1:1/v1"}, world_size=2)
    with pytest.raises(ConfigError, match="rl.backend: openai is not allowed with parallel.tp=2"):
        GRPOTrainer(cfg)


@pytest.mark.slow
def test_tensor_parallel_moe_with_router_replay_matches_the_single_process(tmp_path):
    """An MoE model under tp=2: the leader's engine records the routing, every TP rank replays it."""
    from meshtron.testing.multiprocess import run_ranks
    from tests.rl.helpers import grpo_step_gradients

    moe = {**TP_RL, "model.num_moe_experts": "4", "model.moe_router_topk": "2",
           "model.moe_router_enable_expert_bias": "true", "model.moe_router_score_function": "sigmoid",
           "model.moe_shared_expert_intermediate_size": "16"}
    single, grads = grpo_step_gradients(0, 1, {**moe, "train.run_dir": str(tmp_path / "single")})
    ranks = run_ranks("tests.rl.helpers:grpo_step_gradients", 2, timeout_s=300,
                      overrides={**moe, "parallel.tp": "2", "train.run_dir": str(tmp_path / "tp")})
    for history, tp_grads in ranks:
        assert history[0]["reward_mean"] == single[0]["reward_mean"]
        assert history[0]["loss"] == pytest.approx(single[0]["loss"], abs=1e-5)
        assert history[0]["logprob_gap"] < 1e-5
        assert max(float((grads[n] - tp_grads[n]).abs().max()) for n in grads) <= 1e-5


@pytest.mark.slow
def test_tensor_parallel_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Under tp=2 the checkpoint holds the sharded model, optimizer and reference model; a run resumed
    after step 2 repeats steps 3 and 4 of the uninterrupted run."""
    from tests.rl.helpers import resumed_histories

    full, tail = resumed_histories({**TP_RL, "parallel.tp": "2", "train.train_iters": "4"}, 2, tmp_path)
    assert [h["step"] for h in tail] == [3, 4]
    for a, b in zip(full[2:], tail):
        for key in ("reward_mean", "loss", "kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert full[-1]["kl"] > 0
