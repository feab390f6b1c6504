"""Peak FLOP/s and bandwidth: a known GPU gets its datasheet numbers by device name (dense tensor-core
peak of the compute precision), an unknown one a measurement with a note, a CPU its measured fp32
matmul; names are mocked (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from meshtron.training import flops
from meshtron.training.flops import gpu_spec, resolve_bandwidth_gbps, resolve_peak_flops

CUDA = torch.device("cuda")   # a device object only: nothing runs on it here


@pytest.mark.parametrize("name, bf16, tf32, gbps", [
    ("NVIDIA H100 80GB HBM3", 989.4e12, 494.7e12, 3350.0),      # SXM
    ("NVIDIA H100 PCIe", 756.5e12, 378.0e12, 2000.0),
    ("NVIDIA H100 NVL", 835.5e12, 417.5e12, 3900.0),
    ("NVIDIA H200", 989.4e12, 494.7e12, 4800.0),
    ("NVIDIA A100-SXM4-80GB", 312e12, 156e12, 2039.0),
    ("NVIDIA A100-SXM4-40GB", 312e12, 156e12, 1555.0),
    ("NVIDIA A100 80GB PCIe", 312e12, 156e12, 1935.0),
])
def test_known_gpus_get_their_datasheet_numbers(monkeypatch, name, bf16, tf32, gbps):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda *a, **k: pytest.fail("measured a known GPU"))
    assert resolve_peak_flops(None, CUDA, "bf16")[0] == bf16
    assert resolve_peak_flops(None, CUDA, "fp32")[0] == tf32   # fp32 matmuls run as TF32 on CUDA
    assert resolve_bandwidth_gbps(None, CUDA) == (gbps, f"datasheet {gpu_spec(name).name}")


def test_an_unknown_gpu_is_measured_with_a_note(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Future X9")
    asked = []
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda device, dtype: asked.append(dtype) or 123e12)
    monkeypatch.setattr(flops, "measure_copy_bandwidth_gbps", lambda device: 999.0)
    peak, source = resolve_peak_flops(None, CUDA, "bf16")
    assert peak == 123e12 and asked == [torch.bfloat16]
    assert "not in the datasheet table" in source and "train.peak_flops" in source
    gbps, source = resolve_bandwidth_gbps(None, CUDA)
    assert gbps == 999.0 and "measured" in source


def test_a_cpu_is_measured_in_fp32_once_per_machine_and_a_configured_peak_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    asked = []
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda device, dtype: asked.append((device.type, dtype)) or 1e11)
    assert resolve_peak_flops(None, torch.device("cpu"), "bf16") == (1e11, "measured fp32 matmul")
    assert asked == [("cpu", torch.float32)]
    # the next start-up reads the measurement instead of timing a matmul again
    cache = tmp_path / "meshtron" / "peak_flops.json"
    assert resolve_peak_flops(None, torch.device("cpu"), "fp32") == (1e11, f"measured fp32 matmul, cached in {cache}")
    assert asked == [("cpu", torch.float32)]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 999)   # another thread count is another measurement
    resolve_peak_flops(None, torch.device("cpu"), "fp32")
    assert len(asked) == 2
    assert resolve_peak_flops(5e14, CUDA, "bf16") == (5e14, "train.peak_flops")
    assert resolve_bandwidth_gbps(3000.0, CUDA) == (3000.0, "given")


def test_the_trainer_reports_where_its_peak_came_from(tiny_config):
    from meshtron.training import Trainer

    trainer = Trainer(tiny_config(**{"train.peak_flops": "2e11", "train.train_iters": "1"}))
    assert (trainer.peak_flops, trainer.peak_flops_source) == (2e11, "train.peak_flops")
