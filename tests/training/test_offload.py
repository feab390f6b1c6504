"""Optimizer CPU offload equals the on-device optimizer: bit for bit when the device is the CPU (one
process, any fraction; checkpoint resume; gradient copies started in backward or at the step),
within fp32 noise under FSDP and TP on 2 ranks, and on CUDA."""

from __future__ import annotations

import pytest
import torch

from meshtron.testing.multiprocess import run_ranks
from meshtron.training import Trainer
from meshtron.training.offload import OffloadOptimizer, local

COMMON = {"train.train_iters": "4", "scheduler.decay_steps": "4", "checkpoint.save_at_end": "false",
          "optimizer.lr": "3e-3", "optimizer.weight_decay": "0.1"}


def run(tiny_config, **overrides):
    trainer = Trainer(tiny_config(**{**COMMON, **overrides}))
    history = trainer.train()
    return trainer, [r.loss for r in history], {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_offload_equals_the_device_optimizer_bitwise_on_cpu(tiny_config, optimizer):
    opts = {"optimizer.type": optimizer, "optimizer.sgd_momentum": "0.9"}
    _, ref_losses, ref_params = run(tiny_config, **opts)
    for fraction in ("0.5", "1.0"):
        trainer, losses, params = run(tiny_config, **opts, **{"optimizer.offload_fraction": fraction})
        assert isinstance(trainer.optimizer, OffloadOptimizer)
        assert losses == ref_losses
        for name, value in params.items():
            assert torch.equal(value, ref_params[name]), name


@pytest.mark.parametrize("clip, origin", [("0", "in_backward"), ("1e-3", "at_step")], ids=["no_clip", "clipped"])
def test_gradient_copies_start_in_backward_unless_the_gradient_changes(tiny_config, clip, origin):
    """2 micro-batches per step: the copy of the first accumulation is superseded by the second's;
    without clipping the step uses the copies made in backward, with clipping (which scales every
    gradient in place) it copies again. Either way the results are the device optimizer's, bitwise."""
    _, ref_losses, ref_params = run(tiny_config, **{"optimizer.clip_grad": clip})
    trainer, losses, params = run(tiny_config, **{"optimizer.clip_grad": clip, "optimizer.offload_fraction": "1.0"})
    assert losses == ref_losses
    for name, value in params.items():
        assert torch.equal(value, ref_params[name]), name
    counts, used = trainer.optimizer.copy_counts, 4 * len(trainer.optimizer.host)   # 4 steps, every parameter
    assert counts == {"in_backward": used if origin == "in_backward" else 0, "at_step": used if origin == "at_step" else 0}
    off = run(tiny_config, **{"optimizer.clip_grad": clip, "optimizer.offload_fraction": "1.0",
                              "optimizer.offload_overlap": "false", "train.train_iters": "1"})[0]
    assert off.optimizer.copy_counts["in_backward"] == 0


def test_fraction_splits_states_between_device_and_host(tiny_config):
    trainer, _, _ = run(tiny_config, **{"optimizer.offload_fraction": "0.5", "train.train_iters": "1"})
    total = sum(p.numel() for p in trainer.model.parameters())
    host = sum(h.master.numel() for h in trainer.optimizer.host.values())
    assert 0.5 * total <= host < 0.5 * total + max(p.numel() for p in trainer.model.parameters())
    states = trainer.optimizer.state_bytes()
    assert states["host"] == 2 * 4 * host          # Adam: exp_avg and exp_avg_sq, fp32
    assert states["device"] == 2 * 4 * (total - host)


def test_resume_with_offload_is_exact(tiny_config, tmp_path):
    straight = run(tiny_config, **{"train.train_iters": "6", "scheduler.decay_steps": "6"})[1]
    offload = {"optimizer.offload_fraction": "0.6", "scheduler.decay_steps": "6"}
    Trainer(tiny_config(**{**COMMON, **offload, "train.train_iters": "3", "checkpoint.save_at_end": "true",
                           "checkpoint.save": str(tmp_path / "ck")})).train()
    resumed = Trainer(tiny_config(**{**COMMON, **offload, "train.train_iters": "6",
                                     "checkpoint.load": str(tmp_path / "ck")})).train()
    assert [r.loss for r in resumed] == straight[3:]


def fsdp_offload_rank(rank: int, world_size: int, overrides: dict[str, str], save_dir: str) -> dict:
    from meshtron.config.loader import load_config
    from meshtron.testing.parity import full_parameters

    trainer = Trainer(load_config(overrides={**overrides, "checkpoint.save": save_dir}, world_size=world_size))
    history = trainer.train()
    trainer.save()
    # a fresh trainer without offload loads the offloaded states under the same layout
    plain = Trainer(load_config(overrides={**overrides, "optimizer.offload_fraction": "0", "checkpoint.load": save_dir},
                                world_size=world_size))
    moments = {}
    for (name, p), q in zip(trainer.model.named_parameters(), plain.model.parameters()):
        mine, theirs = trainer.optimizer.state[p], plain.optimizer.state[q]
        moments[name] = float((local(mine["exp_avg"]) - local(theirs["exp_avg"])).abs().max())
    return {"losses": [r.loss for r in history], "params": full_parameters(trainer.model), "moments": moments,
            "counts": trainer.optimizer.copy_counts}


def test_offload_under_fsdp_matches_single_process(tiny_config, tmp_path):
    base = {"model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
            "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
            "data.seq_length": "32", "train.micro_batch_size": "2", "train.global_batch_size": "4",
            "train.eval_interval": "0", "train.peak_flops": "1e11", "logger.progress_bar": "off",
            "scheduler.warmup_steps": "1", **COMMON, "train.train_iters": "3"}
    _, ref_losses, ref_params = run(tiny_config, **base)
    results = run_ranks("tests.training.test_offload:fsdp_offload_rank", 2, timeout_s=240,
                        overrides={**base, "train.run_dir": str(tmp_path / "run"), "parallel.dp_shard": "2",
                                   "parallel.timeout_s": "60", "optimizer.offload_fraction": "0.5"},
                        save_dir=str(tmp_path / "ck"))
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5, rel=0)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref_params[name], atol=1e-5, rtol=0, msg=name)
        assert max(r["moments"].values()) == 0.0   # the checkpoint carried the host states exactly
        # FSDP writes the gradient shards through collectives (no version change): copied at the step
        assert r["counts"]["in_backward"] == 0 < r["counts"]["at_step"]


def tp_offload_rank(rank: int, world_size: int, overrides: dict[str, str]) -> dict:
    from meshtron.config.loader import load_config
    from meshtron.testing.parity import full_parameters

    trainer = Trainer(load_config(overrides=overrides, world_size=world_size))
    history = trainer.train()
    return {"losses": [r.loss for r in history], "params": full_parameters(trainer.model),
            "counts": getattr(trainer.optimizer, "copy_counts", None)}


@pytest.mark.slow
def test_offload_under_tp_matches_single_process(tiny_config, tmp_path):
    """TP2 + SP with half the states offloaded (tensor-parallel DTensor parameters copied from their
    post-accumulate-grad hooks; no clipping) equals one process without offload. SGD with momentum:
    Adam would turn TP's ~1e-8 gradient noise on near-zero gradients into differences of order lr."""
    base = {"model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
            "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
            "data.seq_length": "32", "train.micro_batch_size": "2", "train.global_batch_size": "4",
            "train.eval_interval": "0", "train.peak_flops": "1e11", "logger.progress_bar": "off",
            "scheduler.warmup_steps": "1", **COMMON, "train.train_iters": "3", "optimizer.clip_grad": "0",
            "optimizer.type": "sgd", "optimizer.sgd_momentum": "0.9", "optimizer.lr": "0.05"}
    _, ref_losses, ref_params = run(tiny_config, **base)
    results = run_ranks("tests.training.test_offload:tp_offload_rank", 2, timeout_s=240,
                        overrides={**base, "train.run_dir": str(tmp_path / "run"), "parallel.tp": "2",
                                   "parallel.timeout_s": "60", "optimizer.offload_fraction": "0.5"})
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5, rel=0)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref_params[name], atol=1e-5, rtol=0, msg=name)
        # copied in backward, but for the vocabulary-parallel embedding, whose gradient arrives replicated
        # (Shard(0) parameter) and is resharded at the step
        assert r["counts"]["in_backward"] == 8 * r["counts"]["at_step"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [True, False])
def test_offload_on_cuda_matches_the_device_optimizer(overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).cuda()
    twin = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).cuda()
    twin.load_state_dict(model.state_dict())
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    offloaded = OffloadOptimizer([{"params": list(model.parameters())}], torch.optim.AdamW, kwargs, 0.7,
                                 overlap=overlap)
    assert any(h.master.is_pinned() for h in offloaded.host.values())
    reference = torch.optim.AdamW(twin.parameters(), foreach=False, **kwargs)
    for step in range(5):
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for m, opt in ((model, offloaded), (twin, reference)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    # with overlap every host gradient was copied from its post-accumulate-grad hook, during backward
    host = 5 * len(offloaded.host)
    assert offloaded.copy_counts == ({"in_backward": host, "at_step": 0} if overlap else {"in_backward": 0, "at_step": host})
