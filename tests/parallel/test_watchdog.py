"""Hang-proofing: a rank that never joins a collective makes the run fail within the timeout, naming
that rank and the phase it was in, with every rank's stack dumped — instead of hanging; a healthy
but slow evaluation does not end the run; SIGUSR1 dumps a rank's stack on demand."""

from __future__ import annotations

import os
import signal
import time

from meshtron.testing.multiprocess import RankError, run_ranks

from .test_layouts import BASE

FSDP2 = {**BASE, "parallel.dp_shard": "2", "train.train_iters": "4"}


def _trainer(overrides, world_size):
    from meshtron.config.loader import load_config
    from meshtron.training import Trainer

    return Trainer(load_config(overrides=overrides, world_size=world_size))


def _train_or_message(trainer) -> str:
    from meshtron.training import TrainingError

    try:
        trainer.train()
    except TrainingError as e:
        return str(e)
    return "finished without error"


def hang_in_forward(rank: int, world_size: int, overrides: dict[str, str], hang_ranks: list[int],
                    hang_step: int) -> str:
    """The ranks in `hang_ranks` stop forever in the forward of micro-batch 0 of step `hang_step`."""
    trainer = _trainer(overrides, world_size)
    if rank in hang_ranks:
        forward_loss = trainer._forward_loss

        def stuck(mb):
            if trainer.step + 1 == hang_step:
                time.sleep(3600)
            return forward_loss(mb)

        trainer._forward_loss = stuck
    return _train_or_message(trainer)


def hang_in_evaluation(rank: int, world_size: int, overrides: dict[str, str], hang_rank: int) -> str:
    """Rank `hang_rank` stops forever before its first validation forward (FSDP: the others wait in
    that forward's all-gather)."""
    trainer = _trainer(overrides, world_size)
    if rank == hang_rank:
        forward_loss = trainer._forward_loss

        def stuck(mb):
            if not trainer.model.training:
                time.sleep(3600)
            return forward_loss(mb)

        trainer._forward_loss = stuck
    return _train_or_message(trainer)


def slow_evaluation(rank: int, world_size: int, overrides: dict[str, str], sleep_s: float) -> list[float]:
    """Every rank spends `sleep_s` (more than twice the timeout) in each evaluation, outside collectives."""
    trainer = _trainer(overrides, world_size)
    evaluate = trainer.evaluate

    def slow():
        time.sleep(sleep_s)
        return evaluate()

    trainer.evaluate = slow
    return [r.loss for r in trainer.train()]


def signal_rank(rank: int, world_size: int, overrides: dict[str, str], signal_target: int, at_step: int) -> int:
    """Rank 0 sends SIGUSR1 to rank `signal_target` during step `at_step`; training goes on. Returns the pid."""
    import torch.distributed as dist

    trainer = _trainer(overrides, world_size)
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        forward_loss = trainer._forward_loss

        def forward_and_signal(mb):
            if trainer.step + 1 == at_step and trainer.model.training:
                os.kill(pids[signal_target], signal.SIGUSR1)
            return forward_loss(mb)

        trainer._forward_loss = forward_and_signal
    trainer.train()
    return os.getpid()


def _dumps(run_dir):
    return {p.name: p.read_text() for p in (run_dir / "stacks").iterdir()}


def test_rank_hung_inside_a_step_is_named_with_its_phase(tmp_path):
    run_dir = tmp_path / "run"
    overrides = {**FSDP2, "train.run_dir": str(run_dir), "parallel.timeout_s": "5"}
    t0 = time.monotonic()
    waiting, stuck = run_ranks("tests.parallel.test_watchdog:hang_in_forward", 2, timeout_s=120,
                               allow_failures=True, overrides=overrides, hang_ranks=[1], hang_step=2)
    assert time.monotonic() - t0 < 100  # far below the launcher's kill timeout: the run ended by itself
    assert isinstance(stuck, RankError)  # the stuck rank was ended by its watchdog
    assert waiting.startswith("a collective in training step 2, phase forward of micro-batch 0 failed or timed out")
    assert "rank(s) [1] did not arrive (rank 1 was last in training step 2, phase forward of micro-batch 0)" in waiting
    dumps = _dumps(run_dir)
    assert set(dumps) == {"rank0.txt", "rank1.txt"}
    assert "collective failed in training step 2" in dumps["rank0.txt"]
    # the stuck rank printed one line naming where it was and why it exits (the abort flag, or its own
    # backstop if that fired first), then its stack
    first_line = dumps["rank1.txt"].splitlines()[0]
    assert first_line.startswith("meshtron watchdog: rank 1 ")
    assert "training step 2, phase forward of micro-batch 0" in first_line
    assert "in stuck" in dumps["rank1.txt"]


def test_rank_that_never_starts_a_step_is_named(tmp_path):
    """Rank 1 stops between steps (in data loading): the others time out in step 2's first collective."""
    run_dir = tmp_path / "run"
    overrides = {**FSDP2, "train.run_dir": str(run_dir), "parallel.timeout_s": "5"}
    results = run_ranks("meshtron.testing.parity:hang_one_rank", 2, timeout_s=120, allow_failures=True,
                        overrides=overrides, hang_rank=1, hang_step=2)
    waiting, stuck = results
    assert isinstance(stuck, RankError)
    assert waiting.startswith("a collective in training step 2, phase communication failed or timed out after 5s")
    assert "rank(s) [1] did not arrive (rank 1 was last in between activities (after stop-signal check after step 1))" in waiting
    dumps = _dumps(run_dir)
    assert "run aborted by another rank" in dumps["rank1.txt"] and "in stuck" in dumps["rank1.txt"]


def test_every_rank_stalled_outside_collectives_is_ended_by_the_backstop(tmp_path):
    """No collective ever fails when all ranks stall in compute: each ends itself after 2 x timeout."""
    run_dir = tmp_path / "run"
    overrides = {**FSDP2, "train.run_dir": str(run_dir), "parallel.timeout_s": "3"}
    results = run_ranks("tests.parallel.test_watchdog:hang_in_forward", 2, timeout_s=120,
                        allow_failures=True, overrides=overrides, hang_ranks=[0, 1], hang_step=2)
    assert all(isinstance(r, RankError) for r in results)
    dumps = _dumps(run_dir)
    # the first rank to notice names itself; the other ends either by its own backstop or by the abort flag
    text = dumps["rank0.txt"] + dumps["rank1.txt"]
    assert "made no progress for" in text and "in training step 2, phase forward of micro-batch 0" in text
    for rank in (0, 1):
        assert "stuck outside collectives" in dumps[f"rank{rank}.txt"] or "run aborted" in dumps[f"rank{rank}.txt"]


def test_slow_evaluation_does_not_end_a_healthy_run(tmp_path):
    """An evaluation of 2.5 x timeout between steps: the watchdog's backstop is paused outside training
    steps, so the run finishes."""
    overrides = {**BASE, "parallel.dp_shard": "2", "train.train_iters": "2", "train.eval_interval": "1",
                 "train.eval_iters": "1", "train.run_dir": str(tmp_path / "run"), "parallel.timeout_s": "3"}
    losses = run_ranks("tests.parallel.test_watchdog:slow_evaluation", 2, timeout_s=180, overrides=overrides,
                       sleep_s=7.5)
    assert losses[0] == losses[1]  # the old watchdog ended both ranks 6 s into the first evaluation
    assert len(losses[0]) == 2


def test_rank_hung_in_evaluation_is_named(tmp_path):
    run_dir = tmp_path / "run"
    overrides = {**FSDP2, "train.eval_interval": "1", "train.eval_iters": "1", "train.run_dir": str(run_dir),
                 "parallel.timeout_s": "5"}
    waiting, stuck = run_ranks("tests.parallel.test_watchdog:hang_in_evaluation", 2, timeout_s=120,
                               allow_failures=True, overrides=overrides, hang_rank=1)
    assert isinstance(stuck, RankError)
    assert waiting.startswith("a collective in evaluation after step 1, phase forward of validation batch 0 failed")
    assert "rank(s) [1] did not arrive (rank 1 was last in evaluation after step 1" in waiting


def test_sigusr1_dumps_the_stack_of_a_running_rank(tmp_path):
    run_dir = tmp_path / "run"
    overrides = {**FSDP2, "train.run_dir": str(run_dir), "parallel.timeout_s": "30"}
    run_ranks("tests.parallel.test_watchdog:signal_rank", 2, timeout_s=120, overrides=overrides, signal_target=1,
             at_step=2)
    dump = (run_dir / "stacks" / "rank1.txt").read_text()
    # faulthandler's Python stack of every thread: the main thread inside the training loop,
    # and the watchdog's polling thread
    assert "(most recent call first)" in dump
    assert 'meshtron/training/trainer.py", line' in dump and "in train" in dump
    assert "in _watch" in dump
    assert (run_dir / "stacks" / "rank0.txt").read_text() == ""  # rank 0 was not signalled
