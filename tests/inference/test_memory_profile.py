"""KV-cache sizing: the budget arithmetic against hand-computed numbers, the profiled step on a tiny
model with mocked device memory (the cache grows from the old fixed 512 MiB to what the memory
leaves), the CPU default, and the one-line refusal when nothing is left."""

from __future__ import annotations

import pytest
import torch

from meshtron.config.fields import ConfigError
from meshtron.inference.config import CPU_KV_CACHE_MB, EngineConfig
from meshtron.inference.memory_profile import kv_cache_budget_bytes, profile_chunks, size_kv_cache
from meshtron.inference.runner import kv_bytes_per_token
from tests.inference.helpers import engine, tiny_model

GIB = 2**30


class FakeMemory:
    """An 80 GiB device with `free` bytes free whose profiled step peaks `step` bytes above the start."""

    def __init__(self, free: int, step: int, total: int = 80 * GIB):
        self.free, self.step, self.total, self.resets = free, step, total, 0

    def info(self):
        return self.free, self.total

    def allocated(self):
        return 5 * GIB

    def reset_peak(self):
        self.resets += 1

    def peak(self):
        return 5 * GIB + self.step


def test_budget_arithmetic():
    # 0.9 x 80 GiB = 72 GiB, less 20 GiB in use and a 2 GiB step: 50 GiB
    assert kv_cache_budget_bytes(80 * GIB, 60 * GIB, 2 * GIB, 0.9) == 50 * GIB
    assert kv_cache_budget_bytes(80 * GIB, 60 * GIB, 2 * GIB, 0.5) == 18 * GIB
    with pytest.raises(ConfigError, match=r"^engine.gpu_memory_utilization: 0.25 of 80.0 GiB leaves nothing"):
        kv_cache_budget_bytes(80 * GIB, 60 * GIB, 2 * GIB, 0.25)


def test_profile_chunks_cover_the_token_budget():
    chunks = profile_chunks(100, 40, 16)
    assert [len(c.token_ids) for c in chunks] == [40, 40, 20]
    assert [c.block_ids for c in chunks] == [[0, 1, 2], [3, 4, 5], [6, 7]]  # distinct blocks


@torch.inference_mode()
def test_profiled_size_on_mocked_memory():
    model = tiny_model()
    memory = FakeMemory(free=60 * GIB, step=2 * GIB)
    cfg = size_kv_cache(model, EngineConfig(max_num_batched_tokens=64, block_size=4), torch.device("cpu"),
                        memory=memory)
    # the profile's own cache (64 tokens in 16 blocks + the scratch block) is not part of the step's peak
    profile_cache = 17 * 4 * kv_bytes_per_token(model)
    assert cfg.kv_cache_memory_mb * 2**20 == pytest.approx(50 * GIB + profile_cache)
    assert memory.resets == 1
    resolved = cfg.resolve(96, kv_bytes_per_token(model))
    assert resolved.num_blocks == int(cfg.kv_cache_memory_mb * 2**20) // (kv_bytes_per_token(model) * 4)
    assert resolved.num_blocks * 4 * kv_bytes_per_token(model) > 512 * 2**20  # more than the old fixed default


def test_explicit_sizes_win_and_the_cpu_keeps_its_default():
    model = tiny_model()
    memory = FakeMemory(free=60 * GIB, step=2 * GIB)
    for explicit in (EngineConfig(kv_cache_memory_mb=64.0), EngineConfig(num_blocks=10)):
        assert size_kv_cache(model, explicit, torch.device("cpu"), memory=memory) == explicit
    assert memory.resets == 0  # nothing profiled
    assert size_kv_cache(model, EngineConfig(), torch.device("cpu")).kv_cache_memory_mb == CPU_KV_CACHE_MB
    eng = engine(model, block_size=4)
    assert eng.config.num_blocks == int(CPU_KV_CACHE_MB * 2**20) // (4 * kv_bytes_per_token(model))


def test_utilization_is_checked():
    with pytest.raises(ConfigError, match="engine.gpu_memory_utilization: 1.5 is not allowed"):
        EngineConfig(gpu_memory_utilization=1.5).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiling free memory needs a CUDA device")
def test_engine_on_cuda_sizes_its_cache_from_free_memory():
    model = tiny_model().cuda()
    free, total = torch.cuda.mem_get_info()
    eng = engine(model, block_size=4, gpu_memory_utilization=0.5)
    cache_bytes = eng.config.num_blocks * 4 * kv_bytes_per_token(model)
    assert cache_bytes <= 0.5 * total - (total - free)
    assert cache_bytes >= 0.9 * (0.5 * total - (total - free)) - 2**30  # a tiny model's step is well under 1 GiB
