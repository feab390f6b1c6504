"""Sizing the KV cache from free accelerator memory, as vLLM does: one forward of the largest step
the scheduler can hand out is profiled, and `engine.gpu_memory_utilization` of the device's memory,
less what the process already holds (weights, CUDA context, other processes) and that step's peak,
goes to keys and values. On a CPU the cache keeps a fixed size (`CPU_KV_CACHE_MB`): the machine's
memory is shared with everything else, so a fraction of it is no safe default.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol

import torch
from torch import nn

from meshtron.config.fields import ConfigError
from meshtron.inference.config import CPU_KV_CACHE_MB, EngineConfig
from meshtron.inference.paged_context import PagedKVCache, build_paged_batch
from meshtron.inference.scheduler import ScheduledChunk

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)


class DeviceMemory(Protocol):
    def info(self) -> tuple[int, int]: ...  # (free, total) bytes of the device

    def allocated(self) -> int: ...  # bytes this process's tensors hold now

    def reset_peak(self) -> None: ...

    def peak(self) -> int: ...  # the most `allocated()` was since reset_peak()


class CudaMemory:
    def __init__(self, device: torch.device):
        self.device = device

    def info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def kv_cache_budget_bytes(total: int, free: int, step_peak: int, utilization: float) -> int:
    """Bytes for keys/values: utilization x total, less what is in use now (total - free: weights,
    the CUDA context, other processes) and the profiled step's peak above it."""
    budget = int(total * utilization) - (total - free) - step_peak
    if budget <= 0:
        gib = 2**30
        raise ConfigError(f"engine.gpu_memory_utilization: {utilization} of {total / gib:.1f} GiB leaves nothing for "
                          f"the KV cache ({(total - free) / gib:.1f} GiB in use, {step_peak / gib:.1f} GiB for a "
                          "max-size step); raise it, lower max_num_batched_tokens, or set kv_cache_memory_mb")
    return budget


def profile_chunks(num_tokens: int, max_len: int, block_size: int) -> list[ScheduledChunk]:
    """The largest step: num_tokens prompt tokens, as prompts of at most max_len tokens each."""
    chunks, next_block = [], 0
    for i, start in enumerate(range(0, num_tokens, max_len)):
        n = min(max_len, num_tokens - start)
        blocks = -(-n // block_size)
        chunks.append(ScheduledChunk(f"profile{i}", [0] * n, 0, list(range(next_block, next_block + blocks)), True))
        next_block += blocks
    return chunks


@torch.inference_mode()
def profile_step_peak(model: nn.Module, cfg: EngineConfig, max_len: int, memory: DeviceMemory,
                      device: torch.device) -> int:
    """Peak bytes above the current allocation of one forward of max_num_batched_tokens tokens,
    less the throwaway cache that forward writes its keys/values to (the real cache is sized next)."""
    chunks = profile_chunks(cfg.max_num_batched_tokens, max_len, cfg.block_size)
    cache = PagedKVCache(sum(len(c.block_ids) for c in chunks), cfg.block_size, device)
    batch = build_paged_batch(chunks, cache, "packed")  # one row, every key: the most activation memory
    memory.reset_peak()
    before = memory.allocated()
    logits = model(batch.tokens, batch.ctx)
    peak = memory.peak() - before - cache.num_bytes
    del logits
    cache.release()
    return max(0, peak)


def size_kv_cache(model: nn.Module, cfg: EngineConfig, device: torch.device, recurrent_state: bool = False,
                  memory: Optional[DeviceMemory] = None) -> EngineConfig:
    """`cfg` with kv_cache_memory_mb filled in where it is null: from the profiled free memory on
    CUDA (or with `memory` given), CPU_KV_CACHE_MB elsewhere. num_blocks, when set, wins over both.
    Models with Mamba layers are not profiled yet (their step needs state slots): CPU_KV_CACHE_MB."""
    cfg.validate()
    if cfg.num_blocks is not None or cfg.kv_cache_memory_mb is not None:
        return cfg
    if recurrent_state or (memory is None and device.type != "cuda"):
        return dataclasses.replace(cfg, kv_cache_memory_mb=CPU_KV_CACHE_MB)
    memory = memory or CudaMemory(device)
    max_len = min(cfg.max_model_len or model.cfg.max_position_embeddings, model.cfg.max_position_embeddings)
    free, total = memory.info()  # before the profile: the allocator keeps what it frees
    step_peak = profile_step_peak(model, cfg, max_len, memory, device)
    budget = agree_across_tp(model, kv_cache_budget_bytes(total, free, step_peak, cfg.gpu_memory_utilization), device)
    return dataclasses.replace(cfg, kv_cache_memory_mb=budget / 2**20)


def agree_across_tp(model: nn.Module, budget: int, device: torch.device) -> int:
    """Tensor-parallel ranks run the same scheduler over the same blocks: all take the smallest budget."""
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    if mesh is None:
        return budget
    import torch.distributed as dist

    value = torch.tensor([budget], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=mesh.get_group())
    return int(value.item())
