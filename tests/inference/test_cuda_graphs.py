"""CUDA graphs: bucket choice and the eager fallback rule on any machine; capture and replay
against eager decoding only where CUDA is available."""

from __future__ import annotations

import pytest
import torch

from meshtron.inference.cuda_graphs import bucket_for, is_decode_only
from meshtron.inference.request import SamplingParams
from meshtron.inference.scheduler import ScheduledChunk
from tests.inference.helpers import engine, greedy_params, tiny_model, workload


def test_bucket_choice():
    assert bucket_for(1, (1, 2, 4, 8)) == 1
    assert bucket_for(3, (8, 4, 2, 1)) == 4
    assert bucket_for(9, (1, 2, 4, 8)) is None


def test_only_decode_batches_use_graphs():
    decode = ScheduledChunk("a", [5], 7, [0, 1], samples=True)
    prefill = ScheduledChunk("b", [1, 2, 3], 0, [2], samples=True)
    partial = ScheduledChunk("c", [4], 0, [3], samples=False)
    assert is_decode_only([decode]) and not is_decode_only([decode, prefill]) and not is_decode_only([partial])


def test_cuda_graphs_fall_back_to_eager_off_cuda():
    model = tiny_model()
    with pytest.warns(UserWarning, match="needs a CUDA device"):
        eng = engine(model, num_blocks=64, block_size=4, cuda_graphs=True, device="cpu")
    assert eng.runner.graphs is None
    assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0].finished


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_replay_matches_eager_on_cuda():
    model = tiny_model().cuda()
    prompts, max_tokens = workload(num_requests=12, max_prompt=20, max_output=16)
    eager = engine(model, num_blocks=256, block_size=4).generate(prompts, greedy_params(max_tokens))
    graphed = engine(model, num_blocks=256, block_size=4, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4, 16))
    outputs = graphed.generate(prompts, greedy_params(max_tokens))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    assert graphed.runner.num_forwards["graph"] > 0
    graphed.suspend()  # graphs point at freed cache tensors: dropped, recaptured after resume
    assert graphed.runner.graphs.graphs == {}
    graphed.resume()
    again = graphed.generate(prompts[:4], greedy_params(max_tokens[:4]))
    assert [o.token_ids for o in again] == [o.token_ids for o in eager[:4]]
