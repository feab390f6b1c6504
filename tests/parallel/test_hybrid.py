"""A hybrid Mamba/attention/MLP pattern trains under tensor, pipeline (with mixed stages) and fully
sharded data parallelism exactly as one process does: losses of 3 optimizer steps, the validation
loss and the parameters afterwards (fp32, gloo, forked ranks); a checkpoint saved under TP2 x FSDP2
resumes under one process like the uninterrupted run."""

from __future__ import annotations

import pytest

from meshtron.config.loader import load_config
from meshtron.testing.multiprocess import run_ranks
from meshtron.training import Trainer

from .test_layouts import BASE as LAYOUT_BASE
from .test_pipeline import check_against, run_layout, train_and_evaluate

# 6 sublayers: pipeline stages 'M*-' and 'MM-' (2 stages) mix Mamba with attention and MLP.
# 8 Mamba heads of 8 in 2 groups (TP2 splits both), 4 chunks of 8 per 32-token sequence.
HYBRID = {"model.layer_pattern": "M*-MM-", "model.mamba_head_dim": "8", "model.mamba_num_groups": "2",
          "model.mamba_state_dim": "8", "model.mamba_chunk_size": "8", "train.eval_iters": "2"}
BASE = {**LAYOUT_BASE, **HYBRID}
PACKED = {"data.reset_attention_mask": "true", "data.reset_position_ids": "true"}

LAYOUTS = {
    "tp2": (2, {"parallel.tp": "2"}),
    "pp2": (2, {"parallel.pp": "2"}),
    "fsdp2": (2, {"parallel.dp_shard": "2"}),
    "tp2_no_sp_packed": (2, {"parallel.tp": "2", "parallel.sequence_parallel": "false",
                             "parallel.loss_parallel": "false", **PACKED}),
    "pp2_packed_interleaved": (2, {"parallel.pp": "2", "parallel.pp_schedule": "interleaved_1f1b",
                                   "parallel.pp_virtual_stages": "2", "parallel.pp_first_stage_sublayers": "1",
                                   "parallel.pp_last_stage_sublayers": "1", **PACKED}),
    "tp2_pp2": (4, {"parallel.tp": "2", "parallel.pp": "2"}),
    "tp2_fsdp2": (4, {"parallel.tp": "2", "parallel.dp_shard": "2"}),
}
DEFAULT = {"tp2", "pp2"}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(packed: bool) -> dict:
        if packed not in cache:
            overrides = {**BASE, **(PACKED if packed else {}), "train.run_dir": str(tmp_path_factory.mktemp("ref"))}
            cache[packed] = train_and_evaluate(0, 1, overrides)
        return cache[packed]

    return get


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k in DEFAULT else pytest.mark.slow) for k in LAYOUTS])
def test_hybrid_layout_matches_single_process(layout, references, tmp_path):
    world, extra = LAYOUTS[layout]
    check_against(run_layout(world, {**BASE, **extra}, tmp_path), references("data.reset_attention_mask" in extra))


@pytest.mark.slow
def test_hybrid_checkpoint_reshards(tmp_path):
    common = {**BASE, "train.train_iters": "6", "scheduler.decay_steps": "6", "optimizer.type": "sgd",
              "optimizer.sgd_momentum": "0.9", "optimizer.lr": "0.05", "parallel.timeout_s": "60"}
    ref = Trainer(load_config(overrides={**common, "train.run_dir": str(tmp_path / "ref")}, world_size=1)).train()
    saved = {**common, "train.train_iters": "3", "parallel.tp": "2", "parallel.dp_shard": "2",
             "train.run_dir": str(tmp_path / "saved"), "checkpoint.save_at_end": "true",
             "checkpoint.save": str(tmp_path / "ck")}
    run_ranks("meshtron.testing.parity:train_and_report", 4, timeout_s=240, overrides=saved)
    resumed = Trainer(load_config(overrides={**common, "checkpoint.load": str(tmp_path / "ck"),
                                             "train.run_dir": str(tmp_path / "resumed")}, world_size=1)).train()
    assert [r.loss for r in resumed] == pytest.approx([r.loss for r in ref][3:], abs=1e-6, rel=0)


# Mamba + MoE: pipeline stages 'M*E' and '-ME' (2 even stages) each hold a Mamba mixer and an MoE layer
HYBRID_MOE = {**BASE, "model.layer_pattern": "M*E-ME", "model.num_moe_experts": "4", "model.moe_router_topk": "2"}


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return train_and_evaluate(0, 1, {**HYBRID_MOE, "train.run_dir": str(tmp_path_factory.mktemp("moe_ref"))})


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"parallel.tp": "2"}, {"parallel.pp": "2"}], ids=["tp2", "pp2"])
def test_mamba_moe_hybrid_matches_single_process(extra, moe_reference, tmp_path):
    check_against(run_layout(2, {**HYBRID_MOE, **extra}, tmp_path), moe_reference)
