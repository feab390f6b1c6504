"""Router replay under a 1F1B pipeline: routing recorded on 2 pipeline ranks equals the single-process
recording, and replaying it (with activation recompute, after the router weights are negated so that
free routing would differ) gives the single-process replayed losses. The pipeline's shape-inference
forward on placeholder tensors neither records nor consumes routing."""

from __future__ import annotations

import pytest
import torch

from meshtron.config.loader import load_config
from meshtron.testing.multiprocess import run_ranks
from meshtron.training import Trainer

from .test_layouts import BASE as LAYOUT_BASE

BASE = {**LAYOUT_BASE, "model.num_layers": "4", "model.num_moe_experts": "4", "model.moe_router_topk": "2",
        "model.moe_layer_freq": "[1, 0, 1, 1]", "model.moe_z_loss_coeff": "0.01",
        "parallel.activation_checkpoint": "full", "train.train_iters": "2"}
PP2 = {"parallel.pp": "2", "parallel.pp_schedule": "1f1b"}


def record_then_replay(rank: int, world_size: int, overrides: dict[str, str]) -> dict:
    """Step 1 records; step 2 replays step 1's routing with negated router weights."""
    from meshtron.nn.moe import ReplayMode, recorded_routing, replays, set_replay_mode, set_replay_targets

    trainer = Trainer(load_config(overrides=overrides, world_size=world_size))
    batch = trainer.loader.next_global_batch()
    set_replay_mode(trainer.model, ReplayMode.RECORD)
    first = trainer.train_step(batch)
    recorded = recorded_routing(trainer.model)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if name.endswith("router.weight"):
                p.neg_()
    set_replay_targets(trainer.model, recorded)
    set_replay_mode(trainer.model, ReplayMode.REPLAY_FORWARD)
    second = trainer.train_step(batch)
    left = {name: len(r.targets) + len(r._for_backward) for name, r in replays(trainer.model).items()}
    return {"losses": [first.loss, second.loss], "recorded": recorded, "left": left}


@pytest.mark.slow
def test_pipeline_records_and_replays_like_one_process(tmp_path):
    ref = record_then_replay(0, 1, {**BASE, "train.run_dir": str(tmp_path / "ref")})
    assert set(ref["recorded"]) == {"layers.1.mixer.router", "layers.5.mixer.router", "layers.7.mixer.router"}
    assert all(len(v) == 4 for v in ref["recorded"].values())  # one entry per micro-batch, recompute not recorded
    results = run_ranks(f"{__name__}:record_then_replay", 2, timeout_s=300,
                        overrides={**BASE, **PP2, "train.run_dir": str(tmp_path / "pp")})
    merged = {}
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0)
        assert not any(r["left"].values())
        merged.update(r["recorded"])
    assert merged.keys() == ref["recorded"].keys()
    for name, entries in ref["recorded"].items():
        assert all(torch.equal(a, b) for a, b in zip(merged[name], entries)), name
