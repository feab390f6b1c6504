"""GRPO under pipeline parallelism against the single process. Every pp rank generates a share of
the prompts with its synced copy of the whole model, the rollouts are swapped, and the pipeline's
last stage computes the GRPO loss: the same rollouts, loss and statistics, and the first optimizer
step sees the same gradients (each stage's on its rank, the tied embedding's on both ends)."""

from __future__ import annotations

import pytest

from tests.rl.test_grpo import TINY_RL

PP_RL = {**TINY_RL, "model.num_layers": "4", "rl.kl_beta": "0.05", "rl.entropy_coef": "0.01",
         "rl.updates_per_step": "2", "rl.eval_problems": "8"}
COMPARED = ("reward_mean", "rollout_tokens", "loss", "entropy", "grad_norm", "ratio_mean", "clip_fraction",
            "train_tokens", "is_weight_mean")


def check_against_single(single, grads, ranks):
    for history, _ in ranks:
        for step in (0, 1):
            for key in COMPARED:
                assert history[step][key] == pytest.approx(single[step][key], rel=1e-4, abs=1e-5), (step, key)
        assert history[0]["logprob_gap"] < 1e-5  # the synced rollout model's log probs equal the stages'
        # after one Adam step the runs differ by Adam-amplified rounding only (PLATFORM.md)
        assert history[1]["kl"] > 0 and history[1]["kl"] == pytest.approx(single[1]["kl"], rel=0.05)
    seen = set()
    for _, pp_grads in ranks:
        for name, g in pp_grads.items():
            assert float((g - grads[name]).abs().max()) <= 1e-5, name
            seen.add(name)
    assert seen == set(grads)  # every parameter is trained by some stage


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_pipeline_grpo_steps_match_the_single_process(tmp_path, schedule):
    from meshtron.testing.multiprocess import run_ranks
    from tests.rl.helpers import grpo_step_gradients

    single, grads = grpo_step_gradients(0, 1, {**PP_RL, "train.run_dir": str(tmp_path / "single")}, steps=2)
    overrides = {**PP_RL, "parallel.pp": "2", "parallel.pp_schedule": schedule, "train.run_dir": str(tmp_path / "pp"),
                 "parallel.pp_virtual_stages": "2" if schedule == "interleaved_1f1b" else "1"}
    if schedule == "interleaved_1f1b":
        overrides["model.tie_word_embeddings"] = "false"
    ranks = run_ranks("tests.rl.helpers:grpo_step_gradients", 2, timeout_s=300, steps=2, overrides=overrides)
    if schedule == "interleaved_1f1b":
        single, grads = grpo_step_gradients(0, 1, {**overrides, "parallel.pp": "1", "parallel.pp_virtual_stages": "1", "parallel.pp_schedule": "1f1b",
                                                   "train.run_dir": str(tmp_path / "single-untied")}, steps=2)
    check_against_single(single, grads, ranks)


@pytest.mark.slow
def test_data_and_pipeline_parallel_warmup_grpo_and_resume(tmp_path):
    """dp2 x pp2 (4 ranks): a warm-up, GRPO steps with an evaluation, a checkpoint with the reference
    model's stages; a run resumed from step 2 repeats steps 3 and 4 of the uninterrupted run, and
    both match the single process."""
    from tests.rl.helpers import grpo_history, resumed_histories

    common = {**PP_RL, "rl.warmup_steps": "2", "rl.warmup_batch_size": "8", "rl.warmup_lr": "1e-3",
              "rl.eval_interval": "2", "rl.eval_samples": "2", "rl.eval_k": "2", "train.train_iters": "4"}
    single = grpo_history(0, 1, {**common, "train.run_dir": str(tmp_path / "single")})
    full, tail = resumed_histories({**common, "parallel.pp": "2"}, 4, tmp_path, timeout_s=600)
    for a, b in zip(single, full):
        for key in ("reward_mean", "rollout_tokens", "loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (a["step"], key)
    assert [h["step"] for h in tail] == [3, 4]
    for a, b in zip(full[2:], tail):
        for key in ("reward_mean", "loss", "kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
