"""Restarts: `checkpoint.load: auto` starts fresh in an empty save directory and resumes from the
newest checkpoint otherwise, so the same command can be run again by a cluster (train and rl); the
ranks refuse to start when they see different checkpoints; misuse is one config line.

Slow: 4 ranks (gloo; NCCL with a GPU each under MESHTRON_TEST_BACKEND=nccl) as 2 simulated nodes (two torchrun launchers on 127.0.0.1, c10d rendezvous), one
rank SIGKILLed between two saves. With --max-restarts 1 the job resumes and logs the uninterrupted
run's losses bit for bit; without restarts every launcher exits non-zero with the watchdog's report
naming the killed rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtron.checkpoint import CheckpointError
from meshtron.cli import main
from meshtron.config import ConfigError
from meshtron.parallel.distributed import check_restartable
from meshtron.testing.multiprocess import backend_env, free_port, rank_backend, rank_device, rank_device_type, run_ranks
from meshtron.training import Trainer
from meshtron.training.resume import NOTHING, UNREADABLE, find_resume_point

AUTO = {"checkpoint.load": "auto", "checkpoint.save_interval": "2", "checkpoint.save_at_end": "false",
        "train.train_iters": "4", "scheduler.decay_steps": "4", "model.hidden_dropout": "0.1"}


def losses(history):
    return [r.loss for r in history]


class Crash(Exception):
    """Stands in for a lost process inside `train_step`."""


def test_auto_starts_fresh_then_resumes_bitwise(tiny_config, tmp_path):
    straight = Trainer(tiny_config(**{**AUTO, "checkpoint.load": "null", "checkpoint.save_interval": "0"})).train()
    first = Trainer(tiny_config(**AUTO))  # the save directory does not exist yet
    assert first.resumed_from is None and first.step == 0
    step = first.train_step

    def crash_in_step_4(batch):
        if first.step == 3:
            raise Crash()
        return step(batch)

    first.train_step = crash_in_step_4
    with pytest.raises(Crash):
        first.train()  # saved after step 2, lost step 3
    assert losses(first.history) == losses(straight)[:3]

    again = Trainer(tiny_config(**AUTO))  # the same command, run again
    assert again.resumed_from == tmp_path / "run" / "checkpoints" and again.step == 2
    assert losses(again.train()) == losses(straight)[2:]  # bitwise: floats compared exactly
    done = Trainer(tiny_config(**AUTO))  # a requeue after the end does nothing more
    assert done.step == 4 and done.train() == []


def _step_dir(root: Path, step: int, complete: bool = True) -> Path:
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    if complete:
        (d / "manifest.json").write_text("{}")
    return d


def test_resume_point_of_a_save_directory(tmp_path):
    root = tmp_path / "ck"
    assert find_resume_point(root) == (None, NOTHING)  # missing
    root.mkdir()
    (root / ".tmp-step_00000004").mkdir()  # an interrupted first save
    _step_dir(root, 6, complete=False)  # no manifest: not a checkpoint
    assert find_resume_point(root) == (None, NOTHING)
    # a crash after the rename, before `latest`: the newest complete step directory
    newest = _step_dir(root, 3)
    _step_dir(root, 2)
    assert find_resume_point(root) == (newest, 3)
    (root / "latest").write_text("step_00000002\n")  # the pointer wins: the loader follows and verifies it
    assert find_resume_point(root) == (root, 2)
    (root / "latest").write_text("../elsewhere\n")
    assert find_resume_point(root) == (root, UNREADABLE)


def test_a_broken_latest_is_an_error_not_a_fresh_start(tiny_config, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "latest").write_text("step_00000002\n")  # names a directory that is gone
    with pytest.raises(CheckpointError, match="step_00000002"):
        Trainer(tiny_config(**AUTO))


def test_auto_misuse_is_one_config_line(tiny_config, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^checkpoint\.load: 'auto' is not allowed; .*save_interval"):
        tiny_config(**{**AUTO, "checkpoint.save_interval": "0"})
    (tmp_path / "file").write_text("")
    rc = main(["train", "--checkpoint.load", "auto", "--checkpoint.save", str(tmp_path / "file"),
               "--train.run_dir", str(tmp_path / "run"), "--train.peak_flops", "1e11", "--data.seq_length", "32",
               "--model.num_layers", "1", "--model.hidden_size", "32", "--model.num_attention_heads", "4"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: checkpoint.save:") and "\n" not in err


def agreed_resume_point(rank: int, world_size: int, roots: list[str]) -> str:
    """Each rank resolves `load: auto` against its own view (`roots[rank]`) of the save directory."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshtron.config import load_config
    from meshtron.training.resume import resolve_load

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=30))
    cfg = load_config(overrides={"checkpoint.load": "auto", "checkpoint.save": roots[rank]})
    try:
        return str(resolve_load(cfg, rank_device()))
    except CheckpointError as e:
        return f"error: {e}"


def test_ranks_that_see_different_checkpoints_all_refuse(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "local"
    for root in (shared, local):
        root.mkdir()
    (shared / "latest").write_text("step_00000004\n")
    same = run_ranks("tests.training.test_elastic:agreed_resume_point", 2, roots=[str(shared)] * 2)
    assert same == [str(shared)] * 2
    differ = run_ranks("tests.training.test_elastic:agreed_resume_point", 2, roots=[str(shared), str(local)])
    assert all(r.startswith("error: checkpoint.load: auto: the ranks see different checkpoints") for r in differ)
    assert all("(none to step 4)" in r for r in differ)


def test_rl_trainer_resolves_auto_the_same_way(tmp_path):
    import tests.rl.helpers  # noqa: F401  (registers the 'digits' environment)
    from meshtron.rl.trainer import GRPOTrainer
    from tests.rl.test_grpo import rl_config

    cfg = rl_config(tmp_path, **{"checkpoint.load": "auto", "checkpoint.save_at_end": "true"})
    fresh = GRPOTrainer(cfg)
    assert fresh.step == 0
    fresh.step, fresh.consumed_prompts = 3, 24  # as if three steps had run
    fresh.save()
    resumed = GRPOTrainer(cfg)
    assert (resumed.step, resumed.consumed_prompts) == (3, 24)


def test_a_restart_policy_that_cannot_restart_is_refused():
    torchrun = {"WORLD_SIZE": "4", "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(ConfigError, match=r"^torchrun --max-restarts 1: .*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_restartable(torchrun)
    check_restartable({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "False"})  # each attempt has its own store
    check_restartable({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0"})  # no restarts asked for
    check_restartable({**torchrun, "WORLD_SIZE": "1"})  # no process group
    check_restartable({})  # not under torchrun


# ---- slow: torchrun, two launchers, one rank SIGKILLed ------------------------------------------

WORKER = Path(__file__).with_name("elastic_worker.py")
ROOT = WORKER.parents[2]
TORCHRUN_FLAGS = {
    "model.num_layers": "1", "model.hidden_size": "32", "model.num_attention_heads": "4",
    "model.num_query_groups": "2", "model.ffn_hidden_size": "64", "model.max_position_embeddings": "64",
    "model.make_vocab_size_divisible_by": "128", "data.seq_length": "32", "train.micro_batch_size": "2",
    "train.global_batch_size": "8", "train.train_iters": "6", "train.eval_interval": "0",
    "train.peak_flops": "1e11", "train.num_threads": "1", "logger.progress_bar": "off",
    "logger.log_interval": "1", "scheduler.warmup_steps": "2", "checkpoint.save_interval": "2",
    "checkpoint.save_at_end": "false", "checkpoint.load": "auto", "parallel.timeout_s": "20",
}
LAUNCH_TIMEOUT_S = 420  # a hang guard only: a healthy launch ends long before


def _wait_listening(port: int, proc: subprocess.Popen, limit_s: float = 120) -> None:
    """Until the first launcher's rendezvous store accepts connections (so it, not the second, hosts it)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"the first launcher did not open its rendezvous store on port {port}")


def launch_two_nodes(run_dir: Path, max_restarts: int, kill: str = "",
                     share_store: bool = False) -> list[tuple[int, str]]:
    """Run the tiny job as 2 nodes x 2 ranks; (exit status, output) of each launcher. The first
    launcher hosts the rendezvous and, its address sorting first, is node 0 (ranks 0 and 1; rank 0
    hosts the ranks' store), so a killed rank 2 or 3 takes no store with it. `kill`: the
    MESHTRON_TEST_KILL hook. `share_store`: leave torchrun's agent store shared with the ranks."""
    backend = backend_env(4)  # gloo: no GPU visible; nccl: skipped without 4 GPUs
    gpus = []
    if rank_backend() == "nccl":
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    port = free_port()
    flags = [token for k, v in {**TORCHRUN_FLAGS, "train.device": rank_device_type()}.items()
             for token in (f"--{k}", v)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
           "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
           str(WORKER), "train", *flags, "--train.run_dir", str(run_dir)]
    env = {**os.environ, **backend, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if share_store else "1", "MESHTRON_TEST_KILL": kill}
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = [run_dir / f"launcher{i}.log" for i in range(2)]
    procs = []
    try:
        for i, log in enumerate(logs):
            with open(log, "w") as out:
                # the rendezvous orders nodes by address: 127.0.0.1 is node 0, 127.0.0.2 node 1
                node_cmd = [*cmd[:3], "--local-addr", f"127.0.0.{i + 1}", *cmd[3:]]
                # each simulated node sees its own two GPUs under NCCL (LOCAL_RANK 0 and 1 on both nodes)
                node_env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus[2 * i:2 * i + 2])} if gpus else env
                procs.append(subprocess.Popen(node_cmd, cwd=ROOT, env=node_env, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            if i == 0:
                _wait_listening(port, procs[0])
        codes = [p.wait(timeout=LAUNCH_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def logged_losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss of the `train` records of metrics.jsonl; a step run again after a restart overwrites."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_the_run_ends_with_the_uninterrupted_losses(tmp_path):
    reference = launch_two_nodes(tmp_path / "straight", max_restarts=0)
    assert [code for code, _ in reference] == [0, 0], reference[0][1][-3000:] + reference[1][1][-3000:]
    expected = logged_losses(tmp_path / "straight")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    marker = tmp_path / "killed_rank"
    run_dir = tmp_path / "restarted"
    outcome = launch_two_nodes(run_dir, max_restarts=1, kill=f"3:4:{marker}")
    output = outcome[0][1] + outcome[1][1]
    assert [code for code, _ in outcome] == [0, 0], output[-6000:]
    assert marker.exists()  # rank 3 really died, in step 4 (checkpoints after steps 2 and 4)
    assert "checkpoint: resumed from" in output and "at step 2" in output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 3, 4, 5, 6]  # step 3 ran twice
    assert logged_losses(run_dir) == expected  # bit for bit: JSON floats round-trip exactly


@pytest.mark.slow
def test_without_restarts_every_launcher_ends_with_the_watchdog_report(tmp_path):
    marker = tmp_path / "killed_rank"
    run_dir = tmp_path / "run"
    outcome = launch_two_nodes(run_dir, max_restarts=0, kill=f"3:4:{marker}")
    output = outcome[0][1] + outcome[1][1]
    assert all(code != 0 for code, _ in outcome), output[-6000:]
    assert marker.exists()
    # ranks 0 and 1 (node 0) each end with the watchdog's line naming the missing ranks, rank 3 among them:
    # their own timeout's report, or (a rank that entered the collective later) the first report's abort
    report = [line for line in outcome[0][1].splitlines() if "did not arrive" in line]
    assert len(report) == 2, outcome[0][1][-6000:]
    own = {line.split(" on rank ", 1)[1].split(":", 1)[0] for line in report if line.startswith("error: ")}
    aborted = {line.split("meshtron watchdog: rank ", 1)[1].split(" ", 1)[0] for line in report
               if line.startswith("meshtron watchdog: rank ") and "exits because the run was aborted: " in line}
    assert own and own | aborted == {"0", "1"}, report
    for line in report:
        assert "a collective in training step 4, phase forward of micro-batch 0 failed" in line
        missing = line.split("rank(s) [", 1)[1].split("]", 1)[0]
        assert 3 in {int(r) for r in missing.split(",")}, line
    stacks = {p.name for p in (run_dir / "stacks").iterdir()}
    assert stacks == {f"rank{r}.txt" for r in range(4)}


@pytest.mark.slow
def test_torchrun_restarts_through_a_shared_store_are_refused_at_start(tmp_path):
    outcome = launch_two_nodes(tmp_path / "run", max_restarts=1, share_store=True)
    for code, output in outcome:
        assert code != 0
        assert "error: torchrun --max-restarts 1: a restarted job would reuse the launcher's store" in output, output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step
