"""Every parallel layout trains the same model as one process: the losses of 3 optimizer steps and
the parameters afterwards match the single-process run (fp32, gloo, forked ranks)."""

from __future__ import annotations

import pytest
import torch

from meshtron.testing.multiprocess import run_ranks
from meshtron.training import Trainer

BASE = {
    "model.num_layers": "2", "model.hidden_size": "32", "model.num_attention_heads": "4",
    "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
    "model.make_vocab_size_divisible_by": "128", "data.seq_length": "32",
    "train.micro_batch_size": "2", "train.global_batch_size": "8", "train.train_iters": "3",
    "train.eval_interval": "0", "train.peak_flops": "1e11", "logger.progress_bar": "off",
    "scheduler.warmup_steps": "1", "checkpoint.save_at_end": "false", "optimizer.lr": "1e-3",
}

LAYOUTS = {
    "tp2": (2, {"parallel.tp": "2", "parallel.sequence_parallel": "false", "parallel.loss_parallel": "false"}),
    "tp2_sp": (2, {"parallel.tp": "2"}),
    "fsdp2": (2, {"parallel.dp_shard": "2"}),
    "fsdp4": (4, {"parallel.dp_shard": "4"}),
    # ZeRO-2: gathered parameters stay until backward; only gradients and optimizer states are sharded
    "fsdp2_zero2": (2, {"parallel.dp_shard": "2", "parallel.fsdp_reshard_after_forward": "false"}),
    "hsdp_2x2": (4, {"parallel.dp_replicate": "2", "parallel.dp_shard": "2"}),
    "tp2_fsdp2": (4, {"parallel.tp": "2", "parallel.dp_shard": "2"}),
    # tied embeddings: the vocab-parallel embedding shard is also the head's shard
    "tp2_sp_tied": (2, {"parallel.tp": "2", "model.tie_word_embeddings": "true"}),
    "tp2_tied": (2, {"parallel.tp": "2", "parallel.sequence_parallel": "false", "parallel.loss_parallel": "false",
                     "model.tie_word_embeddings": "true"}),
    "tp2_fsdp2_tied": (4, {"parallel.tp": "2", "parallel.dp_shard": "2", "model.tie_word_embeddings": "true"}),
    # pipeline with tied embeddings: the last stage's copy, gradients summed over the first/last pair
    "pp2_tied": (2, {"parallel.pp": "2", "parallel.pp_schedule": "1f1b", "model.tie_word_embeddings": "true"}),
    "pp2_fsdp2_tied": (4, {"parallel.dp_shard": "2", "parallel.pp": "2", "parallel.pp_schedule": "1f1b",
                           "model.tie_word_embeddings": "true"}),
    "pp4_tied": (4, {"parallel.pp": "4", "parallel.pp_schedule": "1f1b", "model.tie_word_embeddings": "true"}),
    "pp2_interleaved_tied": (2, {"parallel.pp": "2", "parallel.pp_schedule": "interleaved_1f1b",
                                 "parallel.pp_virtual_stages": "2", "model.tie_word_embeddings": "true"}),
    "tp2_sinks_window": (2, {"parallel.tp": "2", "model.softmax_type": "learnable", "model.window_size": "8"}),
}
DEFAULT = {"tp2_sp", "fsdp2", "tp2_fsdp2", "tp2_sp_tied", "pp2_tied"}


MODEL_KEYS = ("model.",)


def single_process(tmp_path, extra):
    """Losses and parameters of the one-process run with the same model options as a layout."""
    from meshtron.config.loader import load_config

    model_extra = {k: v for k, v in extra.items() if k.startswith(MODEL_KEYS)}
    trainer = Trainer(load_config(overrides={**BASE, **model_extra, "train.run_dir": str(tmp_path)}, world_size=1))
    history = trainer.train()
    return [r.loss for r in history], {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return single_process(tmp_path_factory.mktemp("ref"), {})


def check_against_reference(results, reference):
    ref_losses, ref_params = reference
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5, rel=0)
    merged = {}
    for r in results:
        merged.update(r["params"])
    assert set(merged) == set(ref_params)
    for name, value in merged.items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("layout", [pytest.param(k, marks=() if k in DEFAULT else pytest.mark.slow) for k in LAYOUTS])
def test_layout_matches_single_process(layout, reference, tmp_path):
    world, extra = LAYOUTS[layout]
    overrides = {**BASE, **extra, "train.run_dir": str(tmp_path / "run"), "parallel.timeout_s": "60"}
    results = run_ranks("meshtron.testing.parity:train_and_report", world, timeout_s=240, overrides=overrides)
    has_model_options = any(k.startswith(MODEL_KEYS) for k in extra)
    check_against_reference(results, single_process(tmp_path / "ref", extra) if has_model_options else reference)


def bf16_fsdp_report(rank: int, world_size: int, overrides: dict[str, str]) -> dict:
    """Train with bf16 mixed precision under FSDP; record the dtypes the sublayers compute with, the
    dtypes of the sharded parameters, gradients and optimizer states, the reduce dtype, and the losses."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from meshtron.config.loader import load_config

    trainer = Trainer(load_config(overrides=overrides, world_size=world_size))
    seen: dict[str, torch.dtype] = {}
    linear = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))

    def record_weight_dtype(module, args, out):
        seen.setdefault("forward_weight", str(module.weight.dtype))

    linear.register_forward_hook(record_weight_dtype)
    optimizer_step = trainer.optimizer.step

    def step_and_record(*args, **kwargs):
        params = [p for p in trainer.model.parameters() if p.grad is not None]
        seen["sharded_params"] = {str(p.dtype) for p in params}
        seen["grads"] = {str(p.grad.dtype) for p in params}
        seen["grads_sharded"] = all(isinstance(p.grad, DTensor) for p in params)
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = step_and_record
    history = trainer.train()
    states = [s for s in trainer.optimizer.state.values()]
    reduce_dtypes = {str(m._get_fsdp_state()._mp_policy.reduce_dtype) for m in trainer.model.modules()
                     if isinstance(m, FSDPModule)}
    return {"losses": [r.loss for r in history], **seen, "reduce_dtypes": reduce_dtypes,
            "state_dtypes": {str(v.dtype) for st in states for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")}}


def test_bf16_mixed_precision_under_fsdp(reference, tmp_path):
    """bf16 parameters in forward, fp32 gradient reduction, fp32 sharded gradients and Adam states;
    the losses stay within 2e-2 of the fp32 single-process run (bf16 keeps 8 mantissa bits: a relative
    error of about 4e-3 per rounding on losses near ln(vocab) = 5.5, accumulated over a few layers)."""
    overrides = {**BASE, "parallel.dp_shard": "2", "train.precision": "bf16", "train.run_dir": str(tmp_path / "run"),
                 "parallel.timeout_s": "60"}
    results = run_ranks("tests.parallel.test_layouts:bf16_fsdp_report", 2, timeout_s=240, overrides=overrides)
    for r in results:
        assert r["forward_weight"] == "torch.bfloat16"
        assert r["sharded_params"] == {"torch.float32"} and r["grads"] == {"torch.float32"} and r["grads_sharded"]
        assert r["reduce_dtypes"] == {"torch.float32"}
        assert r["state_dtypes"] == {"torch.float32"}
        assert r["losses"] == pytest.approx(reference[0], abs=2e-2, rel=0)
        assert r["losses"] != pytest.approx(reference[0], abs=1e-6, rel=0)  # bf16 really computed

