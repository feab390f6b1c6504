"""Dropout streams per rank (parallel/random.py), on gloo ranks: masks equal where Megatron's semantics
want them equal (tensor-parallel peers on a replicated activation) and different where they must differ
(data-parallel replicas; tp peers on split heads or sequence-parallel positions); a DP2 step with dropout
equals one process computing each replica's micro-batches with that replica's stream (the seed formula
written out below, not meshtron's) and averaging; a resumed run draws the uninterrupted run's masks."""

from __future__ import annotations

import hashlib

import pytest
import torch

from meshtron.testing.multiprocess import run_ranks

from .test_layouts import BASE as LAYOUT_BASE

DROPOUT = {"model.hidden_dropout": "0.2", "model.attention_dropout": "0.2", "train.train_iters": "2",
           "scheduler.decay_steps": "2", "parallel.timeout_s": "60"}


def documented_replica_seed(seed: int, data_rank: int, pp_rank: int = 0) -> int:
    """docs/parallel.md: blake2b-64 of "{seed}/dropout/{data rank}/{pipeline stage}", shifted right by one."""
    text = f"{seed}/dropout/{data_rank}/{pp_rank}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def record_masks(model: torch.nn.Module, masks: dict[str, list[torch.Tensor]]) -> None:
    """Residual and embedding dropout: the positions a Dropout zeroed; attention dropout: the first draw of
    the generator at the attention kernel (scaled_dot_product_attention patched to draw and record it)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout):
            def hook(mod, args, out, name=name):
                if mod.training:
                    masks.setdefault(name, []).append(((out == 0) & (args[0] != 0)).cpu())
            module.register_forward_hook(hook)
    RECORDING["masks"] = masks
    if not hasattr(torch.nn.functional.scaled_dot_product_attention, "original"):
        torch.nn.functional.scaled_dot_product_attention = _recording_sdpa


RECORDING: dict = {}
_SDPA = torch.nn.functional.scaled_dot_product_attention


def _recording_sdpa(q, k, v, *args, dropout_p=0.0, **kwargs):
    if dropout_p > 0 and RECORDING.get("masks") is not None:
        RECORDING["masks"].setdefault("attention", []).append(
            torch.rand(q.shape[:-1] + (k.shape[-2],), device=q.device).cpu())
    return _SDPA(q, k, v, *args, dropout_p=dropout_p, **kwargs)


_recording_sdpa.original = _SDPA


def step_masks(rank: int, world_size: int, overrides: dict[str, str]) -> dict:
    """One training step; -> this rank's coordinates and every mask it drew."""
    from meshtron.config.loader import load_config
    from meshtron.training import Trainer

    trainer = Trainer(load_config(overrides=overrides, world_size=world_size))
    masks: dict[str, list[torch.Tensor]] = {}
    record_masks(trainer.model, masks)
    trainer.train_step(trainer.loader.next_global_batch())
    mesh = trainer.mesh
    return {"dp": mesh["dp_cp"].get_local_rank(), "tp": mesh["tp"].get_local_rank(), "masks": masks}


def _same(a: dict, b: dict, key: str) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["masks"][key], b["masks"][key], strict=True))


@pytest.mark.slow
def test_masks_across_tp2_and_dp2_ranks(tmp_path):
    overrides = {**LAYOUT_BASE, **DROPOUT, "train.run_dir": str(tmp_path / "run"), "parallel.tp": "2",
                 "parallel.dp_shard": "2", "parallel.sequence_parallel": "false", "parallel.loss_parallel": "false"}
    results = run_ranks("tests.parallel.test_random:step_masks", 4, timeout_s=240, overrides=overrides)
    by = {(r["dp"], r["tp"]): r for r in results}
    residual = [k for k in results[0]["masks"] if k.endswith("dropout")]
    assert "embedding_dropout" in residual and len(residual) == 5 and "attention" in results[0]["masks"]
    for dp in (0, 1):
        for key in residual:  # replicated activations: tp peers drop the same units (so the replicas stay equal)
            assert _same(by[dp, 0], by[dp, 1], key), key
            assert by[dp, 0]["masks"][key][0].any()
        assert not _same(by[dp, 0], by[dp, 1], "attention")  # split heads: each tp rank its own stream
    for tp in (0, 1):
        for key in residual + ["attention"]:  # data-parallel replicas: different streams
            assert not _same(by[0, tp], by[1, tp], key), key


@pytest.mark.slow
def test_masks_under_sequence_parallelism(tmp_path):
    overrides = {**LAYOUT_BASE, **DROPOUT, "train.run_dir": str(tmp_path / "run"), "parallel.tp": "2"}
    a, b = run_ranks("tests.parallel.test_random:step_masks", 2, timeout_s=240, overrides=overrides)
    keys = [k for k in a["masks"] if k.endswith("dropout")] + ["attention"]
    assert len(keys) == 6
    for key in keys:  # sequence shards and head shards: each tp rank its own stream
        assert a["masks"][key][0].shape == b["masks"][key][0].shape
        assert not _same(a, b, key), key


SGD = {"optimizer.type": "sgd", "optimizer.weight_decay": "0", "optimizer.clip_grad": "0", "optimizer.lr": "0.5"}


def dp_step_and_resume(rank: int, world_size: int, overrides: dict[str, str]) -> dict:
    """Step 1 (its loss, parameters and masks), a checkpoint, step 2's masks; then a trainer resumed
    from the checkpoint and its step 2's masks."""
    from meshtron.config.loader import load_config
    from meshtron.testing.parity import full_parameters
    from meshtron.training import Trainer

    trainer = Trainer(load_config(overrides=overrides, world_size=world_size))
    masks: dict[str, list[torch.Tensor]] = {}
    record_masks(trainer.model, masks)
    first = trainer.train_step(trainer.loader.next_global_batch())
    out = {"loss": first.loss, "params": full_parameters(trainer.model), "step1": dict(masks)}
    trainer.save()
    masks.clear()
    trainer.train_step(trainer.loader.next_global_batch())
    out["step2"] = dict(masks)
    resumed = Trainer(load_config(overrides={**overrides, "checkpoint.load": overrides["checkpoint.save"]},
                                  world_size=world_size))
    assert resumed.step == 1
    masks.clear()
    record_masks(resumed.model, masks)
    resumed.train_step(resumed.loader.next_global_batch())
    out["resumed_step2"] = dict(masks)
    return out


@pytest.mark.slow
def test_dp2_equals_per_replica_streams_and_resume_is_exact(tmp_path):
    from meshtron.config.loader import load_config
    from meshtron.data.loader import BatchLoader
    from meshtron.training import Trainer

    overrides = {**LAYOUT_BASE, **DROPOUT, **SGD, "checkpoint.save": str(tmp_path / "ck")}
    ranks = run_ranks("tests.parallel.test_random:dp_step_and_resume", 2, timeout_s=300,
                      overrides={**overrides, "train.run_dir": str(tmp_path / "dp"), "parallel.dp_shard": "2"})
    for key in ranks[0]["step1"]:
        assert not all(torch.equal(x, y) for x, y in zip(ranks[0]["step1"][key], ranks[1]["step1"][key])), key
    for r in ranks:  # the resumed run continues each rank's own stream
        assert r["resumed_step2"].keys() == r["step2"].keys()
        for key in r["step2"]:
            assert all(torch.equal(x, y) for x, y in zip(r["resumed_step2"][key], r["step2"][key], strict=True))

    # one process: replica r's micro-batches with replica r's stream, gradients summed over both replicas
    cfg = load_config(overrides={**overrides, "train.run_dir": str(tmp_path / "one")}, world_size=1)
    ref = Trainer(cfg)
    t = cfg.train
    batches = [BatchLoader(ref.train_ds, micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                           seed=cfg.data.seed, dp_rank=r, dp_size=2).next_global_batch() for r in range(2)]
    total = float(sum(mb["loss_mask"].sum() for batch in batches for mb in batch))
    ref.model.train()
    loss_sum = 0.0
    record_masks(ref.model, {})  # the same extra draw at each attention kernel as the ranks made
    try:
        for r, batch in enumerate(batches):
            torch.manual_seed(documented_replica_seed(t.seed, r))
            for mb in batch:
                loss, _, _ = ref._forward_loss(ref._local_micro_batch(mb))
                (loss / total).backward()
                loss_sum += loss.item()
    finally:
        torch.nn.functional.scaled_dot_product_attention = _SDPA
    assert ranks[0]["loss"] == pytest.approx(loss_sum / total, rel=1e-6)
    lr = ref.schedule(1)
    for name, p in ref.model.named_parameters():
        expected = p.detach() - lr * p.grad
        torch.testing.assert_close(ranks[0]["params"][name], expected, atol=2e-6, rtol=1e-5, msg=name)


# ---- one process: the streams' mechanics, fast --------------------------------------------------


def tiny_model(**overrides):
    from meshtron.config.loader import load_config
    from meshtron.models.gpt import GPTModel

    values = {**{k: v for k, v in LAYOUT_BASE.items() if k.startswith("model.")}, **DROPOUT, **overrides}
    cfg = load_config(overrides={**{k: v for k, v in values.items() if k.startswith("model.")}, "data.seq_length": "32"})
    torch.manual_seed(0)
    return GPTModel(cfg.model, 256)


def test_tp_peers_in_one_process_and_the_replicated_seed():
    """Two DropoutRNGs that differ only in the tp rank, on the same (unsharded) model: the replicated
    masks agree, the attention draws do not; the replicated stream is the documented seed."""
    from meshtron.parallel.random import DropoutRNG

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    runs = []
    for tp_rank in (0, 1):
        model = tiny_model()
        rng = DropoutRNG(7, torch.device("cpu"), data_rank=1, num_data=2, tp_rank=tp_rank, num_tp=2)
        assert rng.install([model], sequence_parallel=False) == 2  # the two attention mixers
        rng.reseed()
        assert torch.equal(torch.default_generator.get_state(),
                           torch.Generator().manual_seed(documented_replica_seed(7, 1)).get_state())
        masks: dict = {}
        record_masks(model, masks)
        try:
            model.train()
            model(tokens)
        finally:
            torch.nn.functional.scaled_dot_product_attention = _SDPA
        runs.append({"masks": masks})
    residual = [k for k in runs[0]["masks"] if k.endswith("dropout")]
    assert len(residual) == 5 and all(_same(runs[0], runs[1], k) for k in residual)
    assert not _same(runs[0], runs[1], "attention")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recompute_redraws_the_same_masks(sequence_parallel):
    """Activation recompute restores the default generator before rerunning a sublayer; the sharded
    stream's seed comes out of it, so the recomputed masks and the gradients equal those without it."""
    from meshtron.parallel.activation_checkpoint import apply_activation_checkpoint
    from meshtron.parallel.random import DropoutRNG

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    grads = []
    for recompute in (False, True):
        model = tiny_model()
        if recompute:
            apply_activation_checkpoint(model, "full")
        rng = DropoutRNG(7, torch.device("cpu"), tp_rank=1, num_tp=2)
        rng.install([model], sequence_parallel=sequence_parallel)
        rng.reseed()
        model.train()
        model(tokens).float().logsumexp(-1).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_state_round_trip_and_fallbacks():
    from meshtron.parallel.random import DropoutRNG

    rng = DropoutRNG(3, torch.device("cpu"), data_rank=1, num_data=2)
    rng.reseed()
    torch.rand(10)
    state = rng.state_dict()
    expected = torch.rand(5)
    torch.rand(100)
    assert rng.load_state_dict(state, step=4) and torch.equal(torch.rand(5), expected)
    other = DropoutRNG(3, torch.device("cpu"), data_rank=1, num_data=4)  # another layout: seeded from the step
    assert not other.load_state_dict(state, step=4)
    first = torch.rand(5)
    assert not other.load_state_dict(None, step=4) and torch.equal(torch.rand(5), first)
    assert not torch.equal(first, expected)
    assert len({documented_replica_seed(3, d, pp) for d in range(4) for pp in range(2)}) == 8
    for d in range(4):
        for pp in range(2):  # every data rank and stage on its own documented stream
            DropoutRNG(3, torch.device("cpu"), data_rank=d, num_data=4, pp_rank=pp, num_pp=2).reseed()
            seeded = torch.Generator().manual_seed(documented_replica_seed(3, d, pp))
            assert torch.equal(torch.default_generator.get_state(), seeded.get_state())
    single = DropoutRNG(3, torch.device("cpu"))
    now = torch.default_generator.get_state()
    assert single.load_state_dict(None, step=4)  # one process, old checkpoint: the restored "rng" stays
    assert torch.equal(torch.default_generator.get_state(), now)
