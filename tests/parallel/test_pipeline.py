"""Pipeline parallelism trains the same model as one process: for every schedule and with TP and
FSDP on top, the losses of 3 optimizer steps, the parameters afterwards and the validation loss
match the single-process run (fp32, gloo, forked ranks); checkpoints saved under a pipeline layout
load under others; invalid pipeline settings fail at start-up with one line."""

from __future__ import annotations

import pytest
import torch

from meshtron.config.fields import ConfigError
from meshtron.config.loader import load_config
from meshtron.parallel.dims import ParallelDims
from meshtron.parallel.pipeline import check_pipeline_config
from meshtron.parallel.pipeline_stages import split_layers, stages_of_rank
from meshtron.testing.multiprocess import RankFailure, run_ranks
from meshtron.training import Trainer

from .test_layouts import BASE as LAYOUT_BASE

# 4 layers = 8 sublayers ("*-*-*-*-"): enough for 2 ranks x 2 virtual stages
BASE = {**LAYOUT_BASE, "model.num_layers": "4", "train.eval_iters": "3"}
PACKED = {"data.reset_attention_mask": "true", "data.reset_position_ids": "true"}

PP2 = {"parallel.pp": "2"}
LAYOUTS = {
    "pp2_1f1b": (2, {**PP2, "parallel.pp_schedule": "1f1b"}),
    "pp2_gpipe": (2, {**PP2, "parallel.pp_schedule": "gpipe"}),
    "pp2_interleaved": (2, {**PP2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual_stages": "2"}),
    "pp2_zero_bubble_v": (2, {**PP2, "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual_stages": "2"}),
    "pp2_zero_bubble_1p": (2, {**PP2, "parallel.pp_schedule": "zero_bubble"}),
    "pp2_uneven": (2, {**PP2, "parallel.pp_first_stage_sublayers": "3", "parallel.pp_last_stage_sublayers": "5"}),
    "pp2_interleaved_uneven": (2, {**PP2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual_stages": "2",
                                   "parallel.pp_first_stage_sublayers": "1", "parallel.pp_last_stage_sublayers": "3"}),
    "pp2_recompute": (2, {**PP2, "parallel.activation_checkpoint": "full"}),
    "tp2_pp2": (4, {**PP2, "parallel.tp": "2"}),
    "tp2_pp2_no_sp": (4, {**PP2, "parallel.tp": "2", "parallel.sequence_parallel": "false",
                          "parallel.loss_parallel": "false"}),
    "pp2_fsdp2": (4, {**PP2, "parallel.dp_shard": "2"}),
    "pp2_fsdp2_zero_bubble_v": (4, {**PP2, "parallel.dp_shard": "2", "parallel.pp_schedule": "zero_bubble",
                                    "parallel.pp_virtual_stages": "2"}),
    "tp2_pp2_interleaved": (4, {**PP2, "parallel.tp": "2", "parallel.pp_schedule": "interleaved_1f1b",
                                "parallel.pp_virtual_stages": "2"}),
    "tp2_pp2_fsdp2": (8, {**PP2, "parallel.tp": "2", "parallel.dp_shard": "2"}),
    # context parallel inside the stages: cp-local (zig-zag) hidden states flow between stages
    "cp2_pp2": (4, {**PP2, "parallel.cp": "2"}),
    "cp2_pp2_interleaved": (4, {**PP2, "parallel.cp": "2", "parallel.pp_schedule": "interleaved_1f1b",
                                "parallel.pp_virtual_stages": "2"}),
    "cp2_pp2_zero_bubble_v": (4, {**PP2, "parallel.cp": "2", "parallel.pp_schedule": "zero_bubble",
                                  "parallel.pp_virtual_stages": "2"}),
    "cp2_pp2_fsdp2": (8, {**PP2, "parallel.cp": "2", "parallel.dp_shard": "2"}),
}
DEFAULT = {"pp2_1f1b", "tp2_pp2", "cp2_pp2"}


def train_and_evaluate(rank: int, world_size: int, overrides: dict[str, str]) -> dict:
    """Rank function: train, then one evaluation; losses, validation loss and full parameters."""
    from meshtron.testing.parity import full_parameters

    trainer = Trainer(load_config(overrides=overrides, world_size=world_size))
    history = trainer.train()
    return {"losses": [r.loss for r in history], "skipped": [r.skipped for r in history],
            "eval": trainer.evaluate()["loss"], "params": full_parameters(trainer.model)}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Single-process results by data variant, computed on first use."""
    cache = {}

    def get(variant: dict[str, str]) -> dict:
        key = tuple(sorted(variant.items()))
        if key not in cache:
            overrides = {**BASE, **variant, "train.run_dir": str(tmp_path_factory.mktemp("ref"))}
            cache[key] = train_and_evaluate(0, 1, overrides)
        return cache[key]

    return get


def check_against(results: list[dict], ref: dict) -> None:
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0, nan_ok=True)
        assert r["eval"] == pytest.approx(ref["eval"], abs=1e-5, rel=0)
    merged = {}
    for r in results:
        merged.update(r["params"])
    assert set(merged) == set(ref["params"])
    for name, value in merged.items():
        torch.testing.assert_close(value, ref["params"][name], atol=1e-5, rtol=0, msg=name)


def run_layout(world: int, overrides: dict[str, str], tmp_path) -> list[dict]:
    overrides = {**overrides, "train.run_dir": str(tmp_path / "run"), "parallel.timeout_s": "60"}
    return run_ranks("tests.parallel.test_pipeline:train_and_evaluate", world, timeout_s=300, overrides=overrides)


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k in DEFAULT else pytest.mark.slow) for k in LAYOUTS])
def test_pipeline_matches_single_process(layout, references, tmp_path):
    world, extra = LAYOUTS[layout]
    check_against(run_layout(world, {**BASE, **extra}, tmp_path), references({}))


TIED = {"model.tie_word_embeddings": "true"}


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"parallel.tp": "2"},
                                   {"parallel.tp": "2", "parallel.sequence_parallel": "false",
                                    "parallel.loss_parallel": "false"},
                                   {"parallel.tp": "2", "parallel.pp_schedule": "interleaved_1f1b",
                                    "parallel.pp_virtual_stages": "2"},
                                   {"parallel.tp": "2", "parallel.dp_shard": "2"},
                                   {"parallel.cp": "2"},
                                   {"parallel.tp": "2", "parallel.cp": "2"}],
                         ids=["tp2_pp2", "tp2_pp2_no_sp", "tp2_pp2_interleaved", "tp2_pp2_fsdp2", "cp2_pp2",
                              "tp2_cp2_pp2"])
def test_tied_embeddings_with_tp_or_cp_and_pp(extra, references, tmp_path):
    """Tied embeddings under TP2 x PP2 (and CP x PP): the first stage's vocab-parallel embedding shard
    and the last stage's copy of the same shard have their gradients summed over the first/last pair."""
    world = 2 * int(extra.get("parallel.tp", "1")) * int(extra.get("parallel.dp_shard", "1")) * int(
        extra.get("parallel.cp", "1"))
    check_against(run_layout(world, {**BASE, **TIED, **PP2, **extra}, tmp_path), references(TIED))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"parallel.pp_schedule": "1f1b"},
                                   {"parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual_stages": "2"},
                                   {"parallel.pp_schedule": "1f1b", "parallel.cp": "2"}],
                         ids=["1f1b", "zero_bubble_v", "1f1b_cp2"])
def test_packed_documents_reach_every_stage(extra, references, tmp_path):
    """Document masks and restarted positions are used by later stages too (they get them as inputs;
    under cp every stage gathers the document ids of the whole sequence for its ring attention)."""
    world = 2 * int(extra.get("parallel.cp", "1"))
    check_against(run_layout(world, {**BASE, **PACKED, **PP2, **extra}, tmp_path), references(PACKED))


@pytest.mark.slow
def test_nonfinite_loss_is_skipped_on_every_stage(references, tmp_path):
    """A NaN injected into step 2's first micro-batch loss reaches every pp rank: the step is skipped
    everywhere, and the run goes on exactly like a single-process run that skipped the same step."""
    nan = {"train.debug_nonfinite_steps": "[2]"}
    results = run_layout(2, {**BASE, **PP2, **nan}, tmp_path)
    ref = references(nan)
    assert ref["skipped"] == [False, True, False]
    assert all(r["skipped"] == ref["skipped"] for r in results)
    check_against(results, ref)


# ---- checkpoints: save under TP2 x PP2, load under other layouts --------------------------------

# 4 kv heads so that TP4 divides them; SGD with momentum, as in test_reshard.py
CKPT = {**BASE, "model.num_query_groups": "4", "train.train_iters": "6", "scheduler.decay_steps": "6",
        "optimizer.type": "sgd", "optimizer.sgd_momentum": "0.9", "optimizer.lr": "0.05", "parallel.timeout_s": "60"}


@pytest.fixture(scope="module")
def saved_tp2_pp2(tmp_path_factory):
    """(uninterrupted single-process losses, checkpoint of step 3 saved under TP2 x PP2)."""
    root = tmp_path_factory.mktemp("pp_ckpt")
    ref = Trainer(load_config(overrides={**CKPT, "train.run_dir": str(root / "ref")}, world_size=1)).train()
    overrides = {**CKPT, **PP2, "parallel.tp": "2", "train.train_iters": "3", "checkpoint.save_at_end": "true",
                 "train.run_dir": str(root / "save"), "checkpoint.save": str(root / "ck")}
    run_ranks("meshtron.testing.parity:train_and_report", 4, timeout_s=300, overrides=overrides)
    return [r.loss for r in ref], root / "ck"


@pytest.mark.slow
@pytest.mark.parametrize("world, extra", [
    (1, {}),
    (4, {"parallel.dp_shard": "4"}),
    (4, {"parallel.tp": "4"}),
    (4, {**PP2, "parallel.dp_shard": "2", "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual_stages": "2"}),
], ids=["one_process", "fsdp4", "tp4", "pp2_interleaved_fsdp2"])
def test_checkpoint_from_tp2_pp2_resumes(saved_tp2_pp2, tmp_path, world, extra):
    ref_losses, ck = saved_tp2_pp2
    overrides = {**CKPT, **extra, "checkpoint.load": str(ck), "train.run_dir": str(tmp_path / "run")}
    if world == 1:
        losses = [r.loss for r in Trainer(load_config(overrides=overrides, world_size=1)).train()]
    else:
        losses = run_ranks("meshtron.testing.parity:train_and_report", world, timeout_s=300,
                           overrides=overrides)[0]["losses"]
    assert losses == pytest.approx(ref_losses[3:], abs=1e-6, rel=0)


# ---- the split and start-up errors ------------------------------------------------------------

def test_split_even_and_uneven():
    assert split_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert split_layers(8, 4, first=1, last=3) == [range(0, 1), range(1, 3), range(3, 5), range(5, 8)]
    assert split_layers(8, 2, first=3) == [range(0, 3), range(3, 8)]
    assert split_layers(10, 4, first=2, last=2) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]


def test_placement_loop_and_v():
    assert [stages_of_rank(r, 2, 4, "loop") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stages_of_rank(r, 2, 4, "v") for r in range(2)] == [[0, 3], [1, 2]]
    assert [stages_of_rank(r, 4, 8, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("sublayers, stages, first, last, field", [
    (8, 3, None, None, "parallel.pp:"),      # 8 sublayers into 3 stages
    (8, 4, 1, None, "parallel.pp:"),         # 7 left for 3 stages
    (4, 4, 2, None, "parallel.pp:"),         # 2 left for 3 stages
    (8, 2, 3, 4, "parallel.pp_first_stage_sublayers/pp_last_stage_sublayers:"),  # 3 + 4 != 8
])
def test_split_errors_are_one_line(sublayers, stages, first, last, field):
    with pytest.raises(ConfigError) as err:
        split_layers(sublayers, stages, first, last)
    msg = str(err.value)
    assert msg.startswith(field) and "\n" not in msg


@pytest.mark.parametrize("world, extra, field", [
    (2, {"parallel.pp_schedule": "1f1b", "parallel.pp_virtual_stages": "2"}, "parallel.pp_virtual_stages"),
    (2, {"parallel.pp_schedule": "gpipe", "parallel.pp_virtual_stages": "2"}, "parallel.pp_virtual_stages"),
    (8, {"parallel.pp": "8"}, "train.global_batch_size"),  # 1f1b: 4 micro-batches for 8 stages
    # 9 micro-batches over pp 4: torch's interleaved schedules run rounds of 9 // 4 = 2, which do not divide 9
    (4, {"parallel.pp": "4", "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual_stages": "2",
         "train.global_batch_size": "18"}, "train.global_batch_size"),
    (2, {"parallel.pp_schedule": "zero_bubble", "train.global_batch_size": "10"}, "train.global_batch_size"),
    # tied embeddings need the first and last stage on different ranks (ZB-V puts both on rank 0)
    (2, {"model.tie_word_embeddings": "true", "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual_stages": "2"},
     "model.tie_word_embeddings"),
    (2, {"parallel.pp_schedule": "zero_bubble", "parallel.compile": "true"}, "parallel.compile"),
])
def test_invalid_pipeline_settings_are_one_line(world, extra, field):
    cfg = load_config(overrides={**BASE, **PP2, **extra}, world_size=world)
    with pytest.raises(ConfigError) as err:
        check_pipeline_config(cfg, ParallelDims.from_config(cfg.parallel, world))
    msg = str(err.value)
    assert msg.startswith(field + ":") and "\n" not in msg


@pytest.mark.slow
def test_startup_error_reaches_the_user(tmp_path):
    """Through the trainer on real ranks: a pattern that does not split fails at start-up, one line."""
    overrides = {**BASE, **PP2, "model.num_layers": "3", "parallel.pp_virtual_stages": "2",
                 "parallel.pp_schedule": "interleaved_1f1b", "train.run_dir": str(tmp_path / "run"),
                 "parallel.timeout_s": "60"}
    with pytest.raises(RankFailure, match=r"ConfigError: parallel.pp: the pattern's 6 sublayers do not split"):
        run_ranks("meshtron.testing.parity:train_and_report", 2, timeout_s=120, overrides=overrides)


@pytest.mark.slow
def test_tied_tp2_pp2_checkpoint_resumes_in_one_process(tmp_path):
    """Tied embeddings saved under TP2 x PP2 (both copies under one name, each a vocabulary shard)
    resume in one process (one tied matrix) with the uninterrupted run's losses."""
    tied = {**CKPT, **TIED}
    ref = Trainer(load_config(overrides={**tied, "train.run_dir": str(tmp_path / "ref")}, world_size=1)).train()
    run_ranks("meshtron.testing.parity:train_and_report", 4, timeout_s=300,
              overrides={**tied, **PP2, "parallel.tp": "2", "train.train_iters": "3", "checkpoint.save_at_end": "true",
                         "train.run_dir": str(tmp_path / "save"), "checkpoint.save": str(tmp_path / "ck")})
    overrides = {**tied, "checkpoint.load": str(tmp_path / "ck"), "train.run_dir": str(tmp_path / "run")}
    losses = [r.loss for r in Trainer(load_config(overrides=overrides, world_size=1)).train()]
    assert losses == pytest.approx([r.loss for r in ref][3:], abs=1e-6, rel=0)
