"""Tensor-parallel inference (the training TP plans, two gloo ranks) gives the single-process
greedy tokens. Every rank runs the same engine on the same requests."""

from __future__ import annotations

from meshtron.testing.multiprocess import run_ranks
from tests.inference.helpers import save_tiny_checkpoint, workload

ENGINE = dict(num_blocks=128, block_size=4, max_num_batched_tokens=16)


def tp_rank(rank: int, world_size: int, checkpoint: str, prompts, max_tokens):
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.inference.request import SamplingParams

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(device="cpu", **ENGINE), tp_mesh=mesh)
    local_heads = engine.runner.model.layers[0].mixer.wq.weight.to_local().shape[0]
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens])
    return [o.token_ids for o in outputs], local_heads


def test_tp2_equals_single_process(tmp_path):
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.inference.request import SamplingParams

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt")
    prompts, max_tokens = workload(num_requests=8, max_prompt=20, max_output=10)
    results = run_ranks("tests.inference.test_tp:tp_rank", 2, timeout_s=240, checkpoint=checkpoint,
                        prompts=prompts, max_tokens=max_tokens)
    single = LLMEngine.from_checkpoint(checkpoint, EngineConfig(device="cpu", **ENGINE))
    expected = [o.token_ids for o in single.generate(prompts, [SamplingParams(max_tokens=m, temperature=0)
                                                               for m in max_tokens])]
    full_heads = single.runner.model.layers[0].mixer.wq.weight.shape[0]
    for tokens, local_heads in results:
        assert local_heads == full_heads // 2  # really sharded
        assert tokens == expected
