"""CUDA allocator defaults and the per-interval peak memory metric (CUDA mocked: no GPU needed)."""

from __future__ import annotations

import torch

from meshtron.training import memory
from meshtron.training.memory import configure_cuda_allocator, interval_peak_memory


def mock_cuda(monkeypatch, initialized=False):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)


def test_expandable_segments_by_default_on_cuda(monkeypatch):
    mock_cuda(monkeypatch)
    env = {}
    assert configure_cuda_allocator(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_the_users_setting_wins_and_a_cpu_is_left_alone(monkeypatch):
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    mock_cuda(monkeypatch)
    assert not configure_cuda_allocator(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    mock_cuda(monkeypatch, initialized=True)   # too late: the allocator has read its configuration
    env = {}
    assert not configure_cuda_allocator(env) and env == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not configure_cuda_allocator(env) and env == {}


def test_peak_memory_per_interval_is_reset_each_time(monkeypatch):
    peaks, resets = iter([3 * 2**30, 2**29]), []
    monkeypatch.setattr(memory.torch.cuda, "max_memory_allocated", lambda device=None: next(peaks))
    monkeypatch.setattr(memory.torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    cuda = torch.device("cuda", 0)
    assert interval_peak_memory(cuda) == {"peak_memory_gib": 3.0}
    assert interval_peak_memory(cuda) == {"peak_memory_gib": 0.5}
    assert resets == [cuda, cuda]
    assert interval_peak_memory(torch.device("cpu")) == {}   # a CPU reports none (documented)
