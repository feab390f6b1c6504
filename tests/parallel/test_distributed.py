"""Process start-up on CUDA (issue 18, findings 10 and 12), checked on CPU with the CUDA calls mocked:
the GPU a process takes (LOCAL_RANK when it sees the node's GPUs, device 0 when its launcher shows it
one, one line otherwise), `device_id=` passed to init_process_group for eager NCCL start-up, and
NCCL's flight recorder set to dump into the run directory without overriding the user's settings."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshtron.config.fields import ConfigError
from meshtron.parallel import distributed
from meshtron.parallel.distributed import NCCL_TRACE_DIR, configure_nccl_debugging, cuda_device_index

FLIGHT_RECORDER = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING",
                   "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@pytest.mark.parametrize("local_rank, count, expected", [
    (0, 8, 0), (5, 8, 5),      # torchrun: every process sees the node's GPUs
    (0, 1, 0), (3, 1, 0),      # SLURM --gpus-per-task=1 / CUDA_VISIBLE_DEVICES per task: one GPU each
])
def test_cuda_device_of_a_process(local_rank, count, expected):
    assert cuda_device_index(local_rank, count) == expected


def test_more_processes_than_visible_gpus_is_one_line():
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 5: this process sees only 4 GPUs \(CUDA_VISIBLE_DEVICES='0,1,2,3'\)"):
        cuda_device_index(5, 4, "0,1,2,3")
    with pytest.raises(ConfigError, match="sees no GPU"):
        cuda_device_index(0, 0, "")


def test_flight_recorder_dumps_into_the_run_directory(tmp_path):
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}  # the user's own setting is kept
    applied = configure_nccl_debugging(tmp_path / "run", env)
    prefix = str(tmp_path / "run" / NCCL_TRACE_DIR / "rank_")
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in applied
    assert (tmp_path / "run" / NCCL_TRACE_DIR).is_dir()  # NCCL writes files there but makes no directory


def _start(monkeypatch, tmp_path, local_rank: int, device_count: int) -> dict:
    """init_distributed on 'cuda' with torch's CUDA and process-group calls recorded instead of run."""
    calls: dict = {}
    for key in FLIGHT_RECORDER:
        monkeypatch.delenv(key, raising=False)
    for key, value in {"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.setdefault("set_device", index))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    assert distributed.init_distributed(torch.device("cuda"), 30.0, tmp_path / "run") == 8
    return calls


def test_init_takes_the_local_gpu_and_starts_nccl_eagerly(monkeypatch, tmp_path):
    import os

    calls = _start(monkeypatch, tmp_path, local_rank=3, device_count=8)
    assert calls["set_device"] == 3 and calls["backend"] == "nccl"
    assert calls["device_id"] == torch.device("cuda", 3)  # eager init: NCCL connects now, on this GPU
    assert calls["timeout"].total_seconds() == 30.0
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / NCCL_TRACE_DIR / "rank_")


def test_init_with_one_visible_gpu_per_task(monkeypatch, tmp_path):
    calls = _start(monkeypatch, tmp_path, local_rank=6, device_count=1)
    assert calls["set_device"] == 0 and calls["device_id"] == torch.device("cuda", 0)  # set_device(6) failed here
