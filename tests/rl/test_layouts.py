"""GRPO under the trainer's parallel layouts against one process: the same rollouts (rewards and
token counts), the same loss and statistics, the same gradients on the first optimizer step and
the same weights after it (SGD: w - lr g, no Adam amplification of rounding), and the rollout
engine's log probs equal to the sharded trainer's on the same tokens after the weights changed
(the engine's whole model is gathered from the shards). Layouts RL refuses are refused in one line."""

from __future__ import annotations

import pytest

from tests.rl.test_grpo import TINY_RL

LAYOUT_RL = {**TINY_RL, "model.make_vocab_size_divisible_by": "2", "model.tie_word_embeddings": "false",
             "optimizer.type": "sgd", "optimizer.lr": "0.5", "rl.kl_beta": "0.05", "rl.entropy_coef": "0.01",
             "rl.updates_per_step": "2"}
MOE = {"model.num_moe_experts": "4", "model.moe_router_topk": "2", "model.moe_router_enable_expert_bias": "true",
       "model.moe_router_score_function": "sigmoid", "model.moe_shared_expert_intermediate_size": "16",
       "rl.router_replay": "true",
       # the balancing loss is a function of each micro-batch's expert load, and the ranks pack different
       # micro-batches than one process: only the policy objective is compared
       "model.moe_aux_loss_coeff": "0"}
COMPARED = ("reward_mean", "rollout_tokens", "loss", "entropy", "kl", "grad_norm", "ratio_mean", "clip_fraction",
            "train_tokens", "is_weight_mean")


def check_layout(tmp_path, world_size: int, layout: dict[str, str], extra: dict[str, str] | None = None) -> None:
    from meshtron.testing.multiprocess import run_ranks
    from tests.rl.helpers import grpo_layout_run

    common = {**LAYOUT_RL, **(extra or {})}
    single, grads, weights, single_gap, _ = grpo_layout_run(0, 1, {**common, "train.run_dir": str(tmp_path / "one")})
    ranks = run_ranks("tests.rl.helpers:grpo_layout_run", world_size, timeout_s=600,
                      overrides={**common, **layout, "train.run_dir": str(tmp_path / "layout")})
    assert single_gap <= 1e-5
    pipelined = "parallel.pp" in layout
    seen: set[str] = set()
    for history, layout_grads, layout_weights, gap, sharded in ranks:
        assert sharded  # the policy's parameters are DTensors: the layout was applied
        for key in COMPARED:
            assert history[0][key] == pytest.approx(single[0][key], rel=1e-4, abs=1e-5), key
        assert history[0]["logprob_gap"] < 1e-5
        if pipelined:  # each rank holds its stages' parameters
            assert set(layout_grads) <= set(grads) and set(layout_weights) == set(layout_grads)
            seen |= set(layout_grads)
        else:
            assert set(layout_grads) == set(grads) and set(layout_weights) == set(weights)
        worst_grad = max(float((grads[n] - layout_grads[n]).abs().max()) for n in layout_grads)
        worst_weight = max(float((weights[n] - layout_weights[n]).abs().max()) for n in layout_weights)
        assert worst_grad <= 1e-5 and worst_weight <= 1e-5, (worst_grad, worst_weight)
        assert gap <= 1e-5, gap  # the engine (gathered weights) and the sharded trainer agree
    assert not pipelined or seen == set(grads)  # every parameter is trained by some stage


def test_fsdp2_grpo_step_matches_the_single_process(tmp_path):
    # with activation checkpointing: the wrapped parameter names still map to the engine's and reference's
    check_layout(tmp_path, 2, {"parallel.dp_shard": "2", "parallel.activation_checkpoint": "full"})


@pytest.mark.slow
def test_fsdp2_x_tp2_grpo_step_matches_the_single_process(tmp_path):
    check_layout(tmp_path, 4, {"parallel.dp_shard": "2", "parallel.tp": "2"})


@pytest.mark.slow
def test_ep2_moe_with_router_replay_matches_the_single_process(tmp_path):
    check_layout(tmp_path, 2, {"parallel.dp_shard": "2", "parallel.ep": "2"}, MOE)


@pytest.mark.slow
def test_cp2_grpo_step_matches_the_single_process(tmp_path):
    check_layout(tmp_path, 2, {"parallel.dp_shard": "1", "parallel.cp": "2"})


def test_router_replay_with_pipeline_is_refused(tmp_path):
    from meshtron.config import ConfigError, load_config
    from meshtron.rl.trainer import GRPOTrainer

    cfg = load_config(overrides={**LAYOUT_RL, **MOE, "parallel.pp": "2", "model.num_layers": "4",
                                 "train.run_dir": str(tmp_path)}, world_size=2)
    with pytest.raises(ConfigError, match="rl.router_replay: routing replay is not supported with parallel.pp > 1"):
        GRPOTrainer(cfg)


@pytest.mark.slow
def test_hsdp_grpo_step_matches_the_single_process(tmp_path):
    check_layout(tmp_path, 4, {"parallel.dp_replicate": "2", "parallel.dp_shard": "2"})


@pytest.mark.slow
def test_pp2_x_tp2_grpo_step_matches_the_single_process(tmp_path):
    """Pipeline stages sharded over tp: the last stage's vocabulary-parallel log probs; every rank keeps
    a whole rollout model (its stages gathered over tp, the others broadcast over pp)."""
    check_layout(tmp_path, 4, {"parallel.pp": "2", "parallel.tp": "2"}, {"model.num_layers": "4"})
