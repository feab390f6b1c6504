"""GRPO with two tensor-parallel replicas (4 gloo ranks: dp 2 x tp 2) against the single process: each
TP group's leader (global ranks 0 and 2) runs its own rollout engine on its half of the prompts, its
follower replays the forwards, and the first step's rollouts, loss and gradients equal one process's."""

from __future__ import annotations

import pytest

from tests.rl.test_tensor_parallel import TP_RL


@pytest.mark.slow
def test_two_tensor_parallel_replicas_match_the_single_process(tmp_path):
    from meshtron.testing.multiprocess import run_ranks
    from tests.rl.helpers import grpo_step_gradients

    single, grads = grpo_step_gradients(0, 1, {**TP_RL, "train.run_dir": str(tmp_path / "single")})
    ranks = run_ranks("tests.rl.helpers:grpo_step_gradients", 4, timeout_s=600,
                      overrides={**TP_RL, "parallel.tp": "2", "train.run_dir": str(tmp_path / "dp2_tp2")})
    for history, tp_grads in ranks:
        first = history[0]
        assert first["reward_mean"] == single[0]["reward_mean"]  # the same rollouts, from two engines
        assert first["rollout_tokens"] == single[0]["rollout_tokens"]
        for key in ("loss", "entropy", "grad_norm"):
            assert first[key] == pytest.approx(single[0][key], abs=1e-5), key
        assert first["logprob_gap"] < 1e-5
        assert max(float((grads[n] - tp_grads[n]).abs().max()) for n in grads) <= 1e-5
