"""torch.compile under tensor (and sequence) parallelism (issue 18, finding 15): each sublayer compiled
after apply_tp, its DTensor redistributions inside the graph, trains like the single-process eager
run (losses, gradient norms and parameters afterwards; fp32, forked ranks). The graphs really exist:
sublayers were compiled, dynamo made graphs of them and broke none."""

from __future__ import annotations

import pytest

from meshtron.testing.multiprocess import run_ranks

from .test_layouts import BASE, check_against_reference

# one layer (an attention and an MLP sublayer), one micro-batch, one optimizer step
ONE_STEP = {**BASE, "model.num_layers": "1", "train.global_batch_size": "2", "train.train_iters": "1"}
NO_SP = {"parallel.sequence_parallel": "false", "parallel.loss_parallel": "false"}

# name -> (world size, overrides of the run; all but parallel.* also go to the single-process reference)
LAYOUTS = {
    "tp2_sp_one_step": (2, {**ONE_STEP, "parallel.tp": "2"}),
    "tp2": (2, {**BASE, "parallel.tp": "2", **NO_SP}),
    "tp2_sp": (2, {**BASE, "parallel.tp": "2"}),
    "tp2_sp_tied": (2, {**BASE, "parallel.tp": "2", "model.tie_word_embeddings": "true"}),
    "tp2_pp2": (4, {**BASE, "parallel.tp": "2", "parallel.pp": "2", "parallel.pp_schedule": "1f1b"}),
    "tp2_fsdp2_recompute": (4, {**BASE, "parallel.tp": "2", "parallel.dp_shard": "2",
                                "parallel.activation_checkpoint": "full"}),
}
DEFAULT = {"tp2_sp_one_step"}


def compiled_training(rank: int, world_size: int, overrides: dict[str, str]) -> dict:
    """What train_and_report returns, plus the modules compiled and what dynamo made of them in this rank."""
    from torch._dynamo.utils import counters

    from meshtron.config.loader import load_config
    from meshtron.testing.parity import full_parameters
    from meshtron.training import Trainer

    trainer = Trainer(load_config(overrides=overrides, world_size=world_size))
    history = trainer.train()
    compiled = [m for part in trainer.model_parts for m in part.modules()
                if getattr(m, "_compiled_call_impl", None) is not None]
    return {"losses": [r.loss for r in history], "grad_norms": [r.grad_norm for r in history],
            "params": full_parameters(trainer.model), "compiled": len(compiled),
            "graphs": counters["stats"]["unique_graphs"], "graph_breaks": dict(counters["graph_break"])}


def eager_single_process(tmp_path, overrides: dict[str, str]) -> tuple[list[float], list[float], dict]:
    """Losses, gradient norms and parameters of the one-process eager run of the same model and batches."""
    from meshtron.config.loader import load_config
    from meshtron.training import Trainer

    same = {k: v for k, v in overrides.items() if not k.startswith("parallel.")}
    trainer = Trainer(load_config(overrides={**same, "train.run_dir": str(tmp_path)}, world_size=1))
    history = trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return [r.loss for r in history], [r.grad_norm for r in history], params


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k in DEFAULT else pytest.mark.slow) for k in LAYOUTS])
def test_compiled_tensor_parallel_matches_eager_single_process(layout, tmp_path):
    world, overrides = LAYOUTS[layout]
    ref_losses, ref_norms, ref_params = eager_single_process(tmp_path / "ref", overrides)
    run = {**overrides, "parallel.compile": "true", "train.run_dir": str(tmp_path / "run"), "parallel.timeout_s": "120"}
    results = run_ranks("tests.parallel.test_compile:compiled_training", world, timeout_s=600, overrides=run)
    check_against_reference(results, (ref_losses, ref_params))
    for r in results:
        assert r["grad_norms"] == pytest.approx(ref_norms, abs=1e-5, rel=0)
        # equal sublayers share a graph (their parameters are graph inputs), so graphs <= compiled modules
        assert r["compiled"] >= 1 and r["graphs"] >= 1 and not r["graph_breaks"], (r["compiled"], r["graphs"],
                                                                                  r["graph_breaks"])


@pytest.mark.slow
def test_a_warm_compile_cache_is_not_shared_across_process_groups(tmp_path):
    """TP2 x FSDP2 with recompute, twice on one inductor cache: the two tp groups' graphs differ only in
    the name of their process group, and the second run must not load the other group's graph from the
    cache (it did: "Could not resolve the process group registered under the name 16")."""
    overrides = {**ONE_STEP, "train.global_batch_size": "4", "parallel.tp": "2", "parallel.dp_shard": "2",
                 "parallel.activation_checkpoint": "full"}
    ref_losses, _, ref_params = eager_single_process(tmp_path / "ref", overrides)
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for attempt in range(2):  # the first run fills the cache, the second finds it warm
        run = {**overrides, "parallel.compile": "true", "train.run_dir": str(tmp_path / f"run{attempt}"),
               "parallel.timeout_s": "120"}
        results = run_ranks("tests.parallel.test_compile:compiled_training", 4, timeout_s=600, env=cache,
                            overrides=run)
        check_against_reference(results, (ref_losses, ref_params))
