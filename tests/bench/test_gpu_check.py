"""`make gpu-check`: on a machine without CUDA it prints one line and exits 0; every check's code runs
here at tiny shapes with `device=cpu` (so typos and API misuse fail in CI), each against an
independent reference where one exists on a CPU (an fp32 run, the looped experts, transformers, the
uninterrupted run); the CUDA-only checks report `skip` here and run where CUDA is."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.bench import gpu_check
from meshtron.bench.gpu_check import CHECKS, NOTHING_TO_CHECK, Context, Outcome, run_check, run_checks

ROOT = Path(__file__).resolve().parents[2]
CUDA_ONLY = ("host_syncs", "cuda_graphs")


@pytest.fixture
def ctx(tmp_path):
    torch.manual_seed(0)
    return Context(torch.device("cpu"), True, tmp_path)


def test_make_target_without_cuda_prints_one_line():
    recipe = re.search(r"^gpu-check:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "-m meshtron.bench.gpu_check" in recipe
    env = {"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "meshtron.bench.gpu_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == NOTHING_TO_CHECK + "\n"


def test_main_on_cpu_writes_json_and_a_table(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--device", "cpu", "--only", "environment,checkpoint_resume", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["results"]] == ["environment", "checkpoint_resume"]
    assert data["results"][1]["status"] == "pass"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["check", "status", "seconds"] and lines[2].startswith("checkpoint_resume")
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--only", "nap"])


def test_a_crashing_check_fails_alone(ctx, monkeypatch):
    def broken(ctx):
        raise KeyError("no such field")

    monkeypatch.setitem(CHECKS, "broken", broken)
    monkeypatch.setitem(CHECKS, "fine", lambda ctx: Outcome("pass", 1))
    results = {r.name: r for r in run_checks(ctx, ["broken", "fine"])}
    assert results["broken"].status == "fail" and results["broken"].detail == "KeyError: 'no such field'"
    assert results["fine"].status == "pass" and results["fine"].value == 1


def test_environment_and_sdpa_kernels(ctx):
    env = run_check("environment", CHECKS["environment"], ctx)
    assert env.status == "info" and env.value["device"] == "cpu" and env.value["torch"] == torch.__version__
    kernels = run_check("sdpa_kernels", CHECKS["sdpa_kernels"], ctx)
    assert kernels.status == "info" and set(kernels.value) == {s[0] for s in gpu_check.ATTENTION_SHAPES}
    assert all("attention" in k for k in kernels.value.values()), kernels.value


def test_kernel_name_follows_the_chosen_backend():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 16)
    with sdpa_kernel([SDPBackend.MATH]):
        assert "math" in gpu_check.sdpa_kernel_name(q, q, q, is_causal=True)


def test_bf16_parity_against_fp32(ctx):
    out = gpu_check.check_bf16_parity(ctx, variants=("eager", "recompute"))
    assert out.status == "pass", out
    assert set(out.value) == {"eager", "recompute"} and all(0 < v <= gpu_check.BF16_LOSS_RTOL for v in out.value.values())


@pytest.mark.slow
def test_bf16_parity_compiled(ctx):
    assert gpu_check.check_bf16_parity(ctx, variants=("compile",)).status == "pass"


@pytest.mark.parametrize("name", ["gpt2_throughput", "moe_grouped", "checkpoint_resume", "decode_bandwidth", "offload"])
def test_check_runs_on_cpu(ctx, name):
    result = run_check(name, CHECKS[name], ctx)
    assert result.status in ("pass", "info"), result
    if name == "moe_grouped":
        assert result.status == "pass" and result.value["max_difference"] <= 1e-5
    if name == "checkpoint_resume":
        assert result.status == "pass" and result.value["max_loss_difference"] == 0.0
    if name == "offload":  # nothing is pinned without an accelerator
        assert result.status == "pass" and result.value["pinned"] == 0 and result.value["host_tensors"] > 0
    if name in ("gpt2_throughput", "decode_bandwidth"):
        assert result.value["tokens_per_s"] > 0


def test_engine_matches_transformers(ctx):
    pytest.importorskip("transformers")
    result = run_check("engine_vs_transformers", CHECKS["engine_vs_transformers"], ctx)
    assert result.status == "pass", result


@pytest.mark.parametrize("name", CUDA_ONLY)
def test_cuda_only_checks_skip_without_cuda(ctx, name):
    assert run_check(name, CHECKS[name], ctx).status == "skip"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA checks need a CUDA device")
@pytest.mark.parametrize("name", CUDA_ONLY + ("decode_bandwidth", "offload"))
def test_cuda_checks_on_cuda(tmp_path, name):
    result = run_check(name, CHECKS[name], Context(torch.device("cuda"), False, tmp_path))
    assert result.status in ("pass", "info"), result


def test_datasheet_from_the_device_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert gpu_check.datasheet(torch.device("cuda")) == (989.4e12, 3350e9)
    assert gpu_check.datasheet(torch.device("cpu")) is None


def test_flex_checks_on_cpu(ctx):
    # the flex checks' code at tiny shapes: training flex (forward; CPU has no flex backward) against the
    # float64 loop, and the engine with decode_attention flex against gather
    training = run_check("flex_training", CHECKS["flex_training"], ctx)
    assert training.status == "pass", training
    assert training.value["auto_picks_flex"] is False and training.value["max_abs_err"] < 1e-4
    paged = run_check("flex_paged", CHECKS["flex_paged"], ctx)
    assert paged.status == "pass" and paged.value == {"choice": "flex", "equal": True}, paged
