"""RL rollouts under pipeline parallelism come from the pipeline-parallel engine: each pp rank holds a
copy of its own trained stage (never the whole model), and the rollouts (sampled, seeded) are the
single-process trainer's: the same tokens, log probs within 1e-5, after an optimizer step too (the
stage copies follow the trained weights)."""

from __future__ import annotations

import pytest

from tests.rl.test_grpo import TINY_RL

OVERRIDES = {**TINY_RL, "model.num_layers": "4", "rl.max_new_tokens": "12", "rl.group_size": "4",
             "rl.prompts_per_step": "8", "rl.eval_problems": "8"}


def rollout_rank(rank: int, world_size: int, overrides: dict[str, str]):
    """Rollouts of the first prompts, before and after one GRPO step; -> (tokens, log probs, facts)."""
    from meshtron.config import load_config
    from meshtron.rl.policy import gather_objects
    from meshtron.rl.trainer import GRPOTrainer

    trainer = GRPOTrainer(load_config(overrides=overrides, world_size=world_size))
    rl = trainer.cfg.rl

    def rollouts(step: int):
        share = rl.prompts_per_step // (trainer.dims.dp * trainer.num_shares)
        first = trainer.share_rank * share
        trainer._sync()
        out = trainer.rollouts.generate(trainer.backend, trainer.env, trainer.tokenizer,
                                        [trainer.train_problems[first + i] for i in range(share)], trainer.sampling(),
                                        trainer.cfg.train.seed, step, first_group=first)
        if trainer.share_axes:
            out = gather_objects(out, [trainer.mesh[a].get_group() for a in trainer.share_axes])
        trainer.backend.suspend()
        return [r.completion_ids for r in out], [r.log_probs for r in out]

    before = rollouts(50)
    trainer.grpo_step()
    after = rollouts(51)
    facts = {"backend": type(trainer.backend).__name__,
             "rollout_params": sorted(trainer.rollout_model.state_dict()),
             "trained_params": sorted(n for n, _ in trainer.train_model.named_parameters())}
    return before, after, facts


def check_same(a, b):
    (tokens_a, log_probs_a), (tokens_b, log_probs_b) = a, b
    assert tokens_a == tokens_b
    worst = max(abs(x - y) for la, lb in zip(log_probs_a, log_probs_b) for x, y in zip(la, lb))
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("tied", ["true", "false"])
def test_pp2_rollouts_equal_the_single_process_from_stage_copies(tmp_path, tied):
    from meshtron.testing.multiprocess import run_ranks

    overrides = {**OVERRIDES, "model.tie_word_embeddings": tied}
    single_before, single_after, single_facts = rollout_rank(0, 1, {**overrides, "train.run_dir": str(tmp_path / "one")})
    assert sum(len(t) for t in single_before[0]) > 0
    ranks = run_ranks("tests.rl.test_pipeline_rollouts:rollout_rank", 2, timeout_s=600,
                      overrides={**overrides, "parallel.pp": "2", "train.run_dir": str(tmp_path / "pp")})
    full = set(single_facts["rollout_params"])
    for before, after, facts in ranks:
        assert facts["backend"] == "PipelineEngineBackend"
        # the rank's rollout weights are its own stage's (the trained names), not the whole model's
        assert set(facts["rollout_params"]) == set(facts["trained_params"]) < full
        check_same(before, single_before)
        check_same(after, single_after)
