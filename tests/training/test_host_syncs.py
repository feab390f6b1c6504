"""Host syncs of a training step (issue 18, finding 9) and FSDP's gradient reduction per step (issue 18,
"Also"): the number of device-to-host reads in one `train_step` is a small constant, the same for
1 and 4 micro-batches (it was one `loss.item()` and one token count per micro-batch, one `int(index)`
per micro-batch on the last pipeline stage, one `.cpu()` per gradient group); clipping scales the
gradients with one foreach kernel per group (it was one `mul_` per parameter); and FSDP reduce-
scatters once per step, not once per micro-batch, with the single process's gradients.

On CPU nothing waits at a host read, so the reads are counted where they happen: every call that
meshtron's code makes of Tensor.item/.tolist/.cpu/.numpy/float()/int()/bool()/index(), plus, through
a dispatch mode, the operators that read the device (`_local_scalar_dense`, `nonzero`,
`masked_select`) reached from meshtron's code through torch's functions."""

from __future__ import annotations

import collections
from contextlib import contextmanager

import pytest
import torch

from meshtron.testing.host_reads import count_host_reads
from meshtron.testing.multiprocess import run_ranks


def _step_reads(trainer) -> list[str]:
    """Host reads of the second step (the first one builds lazily: pipeline schedules, FSDP state)."""
    trainer.train_step(trainer.loader.next_global_batch())
    batch = trainer.loader.next_global_batch()
    with count_host_reads(only_meshtron=True) as log:
        trainer.train_step(batch)
    return log


def _config(tmp_path, micro_batches: int, world_size: int = 1, **extra: str):
    from meshtron.config.loader import load_config
    from tests.conftest import TINY

    dp = int(extra.get("parallel.dp_shard", "1"))
    overrides = {**TINY, "train.run_dir": str(tmp_path), "train.global_batch_size": str(2 * micro_batches * dp),
                 "optimizer.clip_grad": "1e-3", "checkpoint.save_at_end": "false", **extra}
    return load_config(overrides=overrides, world_size=world_size)


MAX_READS = 3  # the token count, the loss (with any logged extras: one all-reduce), the grad norm


def test_host_reads_per_step_do_not_grow_with_micro_batches(tmp_path):
    from meshtron.training import Trainer

    one = _step_reads(Trainer(_config(tmp_path / "a", 1)))
    four = _step_reads(Trainer(_config(tmp_path / "b", 4)))
    assert len(one) == len(four), f"1 micro-batch: {one}\n4 micro-batches: {four}"
    assert 0 < len(four) <= MAX_READS, four


def test_mtp_extras_add_no_read_per_micro_batch(tmp_path):
    """Logged extra losses (MTP depths) are summed on the device and reduced with the loss."""
    from meshtron.training import Trainer

    one = _step_reads(Trainer(_config(tmp_path / "a", 1, **{"model.mtp_num_layers": "1"})))
    four = _step_reads(Trainer(_config(tmp_path / "b", 4, **{"model.mtp_num_layers": "1"})))
    assert len(one) == len(four) <= MAX_READS, f"{one}\n{four}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_syncs_per_step_do_not_grow_with_micro_batches(tmp_path):
    """On a GPU, CUDA's own sync detector (set_sync_debug_mode) sees as many synchronizing calls in a
    step of 4 micro-batches as in a step of 1."""
    import warnings

    from meshtron.training import Trainer

    def syncs(m: int) -> list[str]:
        trainer = Trainer(_config(tmp_path / str(m), m, **{"train.device": "cuda"}))
        trainer.train_step(trainer.loader.next_global_batch())
        batch = trainer.loader.next_global_batch()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [str(w.message) for w in caught if "synchroniz" in str(w.message)]

    one, four = syncs(1), syncs(4)
    assert len(one) == len(four), f"{one}\n{four}"


@contextmanager
def count_calls(owner, name: str):
    counts = collections.Counter()
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield counts
    finally:
        setattr(owner, name, original)


def test_clipping_scales_each_group_with_one_kernel():
    """Clipped gradients equal torch's clip_grad_norm_; one foreach kernel, no per-parameter mul_."""
    from meshtron.parallel.clip import clip_grad_norm_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model(torch.randn(5, 8)).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in expected]
    for r, g in zip(reference, expected):
        r.grad = g.clone()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(reference, 0.1))
    with count_calls(torch, "_foreach_mul_") as foreach, count_calls(torch.Tensor, "mul_") as mul, \
            count_host_reads(only_meshtron=True) as reads:
        norm = clip_grad_norm_(list(model.parameters()), 0.1)
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    for p, r in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    assert foreach["_foreach_mul_"] == 1 and mul["mul_"] == 0
    assert len(reads) == 1, reads  # the norm it returns


# ---- several ranks: pipeline, FSDP -----------------------------------------------------------------

def step_reads_rank(rank: int, world_size: int, run_dir: str, extra: dict[str, str]) -> dict[int, list[str]]:
    from meshtron.training import Trainer

    return {m: _step_reads(Trainer(_config(f"{run_dir}/{m}", m, world_size, **extra))) for m in (2, 4)}


@pytest.mark.parametrize("layout", [
    {"parallel.pp": "2", "parallel.pp_schedule": "1f1b"},
    {"parallel.dp_shard": "2"},
], ids=["pp2", "fsdp2"])
def test_host_reads_per_step_on_several_ranks(layout, tmp_path):
    """pp: the last stage's loss finds each micro-batch without reading its index; FSDP: nothing per micro-batch."""
    results = run_ranks("tests.training.test_host_syncs:step_reads_rank", 2, timeout_s=240, run_dir=str(tmp_path),
                        extra={**layout, "parallel.timeout_s": "60"})
    for rank, reads in enumerate(results):
        assert len(reads[2]) == len(reads[4]) <= MAX_READS + 1, f"rank {rank}: {reads}"


def fsdp_reduction_rank(rank: int, world_size: int, run_dir: str) -> dict:
    """Reduce-scatters per step with 1 and 4 micro-batches; the full gradients of the 4-micro-batch step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshtron.training import Trainer

    out: dict = {}
    for m in (1, 4):
        trainer = Trainer(_config(f"{run_dir}/{m}", m, world_size, **{"parallel.dp_shard": "2", "optimizer.clip_grad": "0",
                                                                        "parallel.timeout_s": "60"}))
        grads: dict[str, torch.Tensor] = {}

        def capture(*args, trainer=trainer, grads=grads, step=trainer.optimizer.step, **kwargs):
            for name, p in trainer.model.named_parameters():
                grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            return step(*args, **kwargs)

        trainer.optimizer.step = capture
        with count_calls(dist, "reduce_scatter_single") as single, count_calls(dist, "reduce_scatter_tensor") as rs:
            result = trainer.train_step(trainer.loader.next_global_batch())
        out[m] = {"reduce_scatters": single["reduce_scatter_single"] + rs["reduce_scatter_tensor"],
                  "grads": grads, "loss": result.loss}
    return out


def test_fsdp_reduces_gradients_once_per_step(tmp_path):
    """With 4 micro-batches FSDP reduce-scatters as often as with 1 (once per unit and step), and the
    gradients equal one process's over the same global batch."""
    from meshtron.training import Trainer

    ranks = run_ranks("tests.training.test_host_syncs:fsdp_reduction_rank", 2, timeout_s=240, run_dir=str(tmp_path))
    single = Trainer(_config(tmp_path / "single", 8, **{"optimizer.clip_grad": "0"}))
    grads = {}
    single.optimizer.step = lambda *a, **k: grads.update(
        {n: p.grad.detach().clone() for n, p in single.model.named_parameters()})
    loss = single.train_step(single.loader.next_global_batch()).loss
    for rank, out in enumerate(ranks):
        assert 0 < out[1]["reduce_scatters"] == out[4]["reduce_scatters"], (rank, out[1]["reduce_scatters"],
                                                                            out[4]["reduce_scatters"])
        assert out[4]["loss"] == pytest.approx(loss, abs=1e-6)
        assert set(out[4]["grads"]) == set(grads)
        for name, g in grads.items():  # no clipping: the reduced gradients themselves
            torch.testing.assert_close(out[4]["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)
