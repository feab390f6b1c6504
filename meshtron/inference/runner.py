"""The model runner: everything that is a tensor. The paged KV cache, the batch built from a
`SchedulerOutput`, one forward through the model's paged context, and per-request sampling with
per-request generators (seeded requests sample the same whatever they are batched with).

Layout choice (see `paged_context`): the packed row costs tokens x all keys of attention; rows of
S tokens cost rows x S x longest context of attention, the padded tokens' linear work, and a copy
of every row's keys/values. `choose_layout` estimates each candidate from the model's shape
(FLOPs, with key/value bytes weighted as memory traffic) and takes the cheapest.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from meshtron.inference.config import EngineConfig
from meshtron.inference.decode_attention import select_decode_attention
from meshtron.inference.mamba_state import MambaInferenceStateConfig, MambaStateCache
from meshtron.inference.paged_context import PagedBatch, PagedKVCache, build_paged_batch
from meshtron.inference.request import Request, SamplingParams, TokenLogProbs
from meshtron.inference.sampler import sample_rows
from meshtron.inference.scheduler import SampledToken, ScheduledChunk, SchedulerOutput
from meshtron.inference.speculative import build_speculative
from meshtron.inference.varlen_context import build_varlen_batch


def _local(weight: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel (DTensor) weight's local shard; a plain tensor as it is."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def attention_layers(model: nn.Module) -> list[nn.Module]:
    return [layer.mixer for layer in model.layers if getattr(layer, "symbol", None) == "*"]


def kv_bytes_per_token(model: nn.Module) -> int:
    """Bytes of keys and values one token needs across all attention layers on this rank."""
    total = 0
    element = next(model.parameters()).element_size()
    for mixer in attention_layers(model):
        if hasattr(mixer, "wkv_b"):  # MLA caches expanded per-head keys (d_n + d_r) and values (d_v)
            heads = _local(mixer.wkv_b.weight).shape[0] // (mixer.qk_head_dim + mixer.v_head_dim)
            total += heads * (mixer.qk_head_dim + mixer.qk_pos_emb_head_dim + mixer.v_head_dim)
        else:
            total += 2 * _local(mixer.wk.weight).shape[0]
    return total * element  # 0 without attention layers (a pure Mamba model)


# A byte copied costs about this many FLOPs' time on the machines we run on (CPU: ~100 GFLOP/s
# against ~10 GB/s); only the ranking of layouts depends on it.
FLOPS_PER_BYTE = 10.0


def cost_weights(model: nn.Module) -> tuple[float, float, float]:
    """(FLOPs per query-key pair over all layers, FLOPs per token outside attention products,
    cost of gathering one key/value row across layers)."""
    per_pair = 0.0
    for mixer in attention_layers(model):
        if hasattr(mixer, "wkv_b"):
            per_pair += 2 * mixer.num_heads * (mixer.qk_head_dim + mixer.qk_pos_emb_head_dim + mixer.v_head_dim)
        else:
            per_pair += 4 * _local(mixer.wq.weight).shape[0]  # q.k and p.v, heads x head_dim each
    per_token = 2.0 * sum(_local(p).numel() for n, p in model.named_parameters() if "embedding" not in n)
    return per_pair, per_token, 2 * max(1, kv_bytes_per_token(model)) * FLOPS_PER_BYTE  # copied, then read


def choose_layout(chunks: list[ScheduledChunk], weights: tuple[float, float, float]) -> tuple[str, Optional[int]]:
    """-> ('packed', None) or ('rows', S), whichever the cost estimate says is cheapest."""
    per_pair, per_token, per_key = weights
    num_q = [len(c.token_ids) for c in chunks]
    num_k = [c.start_pos + n for c, n in zip(chunks, num_q)]
    total_q, max_k = sum(num_q), max(num_k)
    best = (total_q * sum(num_k) * (per_pair + per_key) + total_q * per_token, ("packed", None))
    segment, longest = 1, max(num_q)
    while True:
        rows = sum(-(-n // segment) for n in num_q)
        padded_tokens = rows * min(segment, longest)
        cost = padded_tokens * (max_k * per_pair + per_token) + rows * max_k * per_key
        best = min(best, (cost, ("rows", segment)), key=lambda x: x[0])
        if segment >= longest:
            return best[1]
        segment = min(2 * segment, longest)


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: EngineConfig, device: torch.device,
                 draft_model: Optional[nn.Module] = None):
        self.model = model.eval()
        self.cfg, self.device = cfg, device
        self.cache = PagedKVCache(cfg.num_blocks, cfg.block_size, device)
        state_cfg = MambaInferenceStateConfig.from_model(model)
        # one state slot per running request (the scheduler hands them out), plus scratch
        self.states = MambaStateCache(state_cfg, cfg.max_num_seqs, device) if state_cfg is not None else None
        self.generators: dict[str, torch.Generator] = {}
        self.params: dict[str, SamplingParams] = {}
        self.requests: dict[str, Request] = {}
        self.prompt_log_probs: dict[str, list[TokenLogProbs]] = {}  # the last forward's, by request
        self.cost_weights = cost_weights(model)
        self.num_forwards = {"varlen": 0, "packed": 0, "rows": 0, "graph": 0}
        # the varlen layout's decode buckets: the native kernel on a CPU by default, gather + SDPA when None
        self.decode_attention_choice, self.decode_attention = select_decode_attention(model, cfg, device)
        self.graphs = None
        if cfg.cuda_graphs:
            from meshtron.inference.cuda_graphs import CudaGraphRunner

            self.graphs = CudaGraphRunner.create(self.model, self.cache, cfg)
        # engine.speculative_method: verifies drafts in execute() and proposes the next ones (speculative.py)
        self.speculative = build_speculative(self, model, cfg, device, draft_model)

    def add_request(self, request: Request, seed: int, generator_state: Optional[torch.Tensor] = None) -> None:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        if generator_state is not None:
            generator.set_state(generator_state)
        req_id = request.req_id
        self.generators[req_id], self.params[req_id] = generator, request.sampling_params
        self.requests[req_id] = request  # its tokens so far, for penalties and min_tokens

    def generator_state(self, req_id: str) -> torch.Tensor:
        return self.generators[req_id].get_state()

    def remove_request(self, req_id: str) -> None:
        self.generators.pop(req_id, None)
        self.params.pop(req_id, None)
        self.requests.pop(req_id, None)
        if self.speculative is not None:
            self.speculative.forget(req_id)

    @torch.inference_mode()
    def propose_drafts(self, requests: dict[str, Request], kv, max_model_len: int) -> None:
        """Speculative decoding, after the step's tokens were applied: draft the next tokens."""
        if self.speculative is not None:
            self.speculative.propose(requests, kv, max_model_len)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """One forward over the step's chunks; sample the requests whose chunk ends their tokens."""
        if out.is_empty:
            return {}
        if self.speculative is not None:
            return self.speculative.execute(out)
        logits, req_ids = self._forward(out.chunks)
        if not req_ids:
            return {}
        return sample_rows(logits, [self.params[r] for r in req_ids], [self.generators[r] for r in req_ids], req_ids,
                           [self.requests[r] for r in req_ids])

    @torch.inference_mode()
    def forward_only(self, chunks: list[ScheduledChunk]) -> None:
        """The forward of a step whose sampling happens elsewhere (a tensor-parallel follower rank)."""
        if chunks:
            self._forward(chunks)

    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[str]]:
        """-> logits (num_sampling, vocab) and the request id of each row; the prompt log probs the
        step's chunks asked for are left in `prompt_log_probs` (req_id -> positions in order)."""
        self.prompt_log_probs = {}
        scoring = [c for c in chunks if self._prompt_positions(c) is not None]
        if scoring:  # every token's logits are needed, not only the sampled rows': no graph
            logits, req_ids, batch = self._eager_forward(chunks)
            self.prompt_log_probs = self._score(scoring, logits, {c.req_id: i for i, c in enumerate(chunks)}, batch)
            return logits.index_select(0, batch.sample_index), req_ids
        if self.graphs is not None:
            result = self.graphs.run(chunks)
            if result is not None:
                self.num_forwards["graph"] += 1
                return result
        logits, req_ids, batch = self._eager_forward(chunks)
        if len(req_ids) == logits.shape[0]:  # every token is sampled (decodes only): sample_index is arange
            return logits, req_ids
        return logits.index_select(0, batch.sample_index), req_ids

    def _eager_forward(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[str], PagedBatch]:
        """-> the logits of every token (rows * q, vocab), the sampled rows' request ids, the batch."""
        if self.cfg.layout == "varlen":
            self.num_forwards["varlen"] += 1
            batch = build_varlen_batch(chunks, self.cache, self.states, self.decode_attention)
        else:
            if self.cfg.layout == "auto":
                layout, segment_len = choose_layout(chunks, self.cost_weights)
            else:  # 'padded' is one row per sequence
                layout, segment_len = ("packed", None) if self.cfg.layout == "packed" else ("rows", None)
            self.num_forwards[layout] += 1
            batch = build_paged_batch(chunks, self.cache, layout, segment_len)
        logits = self.model(batch.tokens, batch.ctx)  # (rows, q, vocab)
        return logits.reshape(-1, logits.shape[-1]), batch.sample_req_ids, batch

    def _prompt_positions(self, chunk: ScheduledChunk) -> Optional[tuple[int, int]]:
        """The prompt positions [first, last] whose log probs this chunk's logits give and the request
        still lacks (logits at position p score the token at p + 1); None when there are none."""
        request = self.requests.get(chunk.req_id)
        if request is None or request.sampling_params.prompt_logprobs is None:
            return None
        first = max(len(request.prompt_log_probs) + 1, chunk.start_pos + 1)
        last = min(request.num_prompt_tokens - 1, chunk.start_pos + len(chunk.token_ids))
        return (first, last) if first <= last else None

    def _score(self, chunks: list[ScheduledChunk], logits: torch.Tensor, order: dict[str, int],
               batch: PagedBatch) -> dict[str, list[TokenLogProbs]]:
        scores = {}
        for chunk in chunks:
            first, last = self._prompt_positions(chunk)
            request, k = self.requests[chunk.req_id], self.requests[chunk.req_id].sampling_params.prompt_logprobs
            index = batch.token_index[order[chunk.req_id]][first - 1 - chunk.start_pos: last - chunk.start_pos]
            log_probs = logits[torch.from_numpy(index).to(logits.device)].float().log_softmax(-1)
            targets = request.prompt_token_ids[first:last + 1]
            chosen = log_probs.gather(-1, torch.tensor(targets, device=logits.device)[:, None])[:, 0].tolist()
            top = [list(zip(i.tolist(), v.tolist())) for v, i in zip(*log_probs.topk(k, dim=-1))] if k else None
            scores[chunk.req_id] = [TokenLogProbs(t, c, top[j] if top else []) for j, (t, c) in enumerate(zip(targets, chosen))]
        return scores

    def release(self) -> None:
        """Free the cache tensors, captured graphs and generators (suspend)."""
        self.cache.release()
        if self.speculative is not None:
            self.speculative.release()
        if self.states is not None:
            self.states.release()
        if self.graphs is not None:
            self.graphs.release()
        self.generators.clear()
        self.params.clear()
        self.requests.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
