"""megatron-core 0.19.2 on a CPU-only torch, for tests only (meshtron never imports megatron).

Workarounds for the CUDA-only paths (issue 19), all scoped to `cpu_megatron()`:
- a one-rank gloo group for parallel_state, and `model_parallel_cuda_manual_seed(seed,
  inference_rng_tracker=True)` (the default tracker forks CUDA RNG states);
- `torch.cuda.current_device` answers "cpu": RotaryEmbedding.get_emb moves inv_freq there,
  GlobalMemoryBuffer.get_tensor allocates there, and saving builds its failure flag there;
- `torch.cuda.synchronize` does nothing (saving calls it);
- forward is given an explicit causal mask (attention_mask=None builds one on CUDA);
- saving collects its write results in a plain queue: a synchronous save writes in this process, and
  megatron's default (a queue served by a spawned multiprocessing manager) costs a process start and
  keeps a forked rank from exiting.
"""

from __future__ import annotations

import argparse
import datetime
import queue
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|deprecated|DEPRECATED).*")


@contextmanager
def cpu_megatron(seed: int = 1234, tp: int = 1):
    """parallel_state initialised on a one-rank gloo group (or, with tp > 1, on the ranks run_ranks
    started: their environment names the rendezvous), with the CUDA calls patched (see above)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    owns_group = not dist.is_initialized()
    if owns_group and tp > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    elif owns_group:
        store = Path(tempfile.mkdtemp(prefix="megatron-store-")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120))
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
            mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None), \
            mock.patch.object(filesystem_async, "_results_queue", queue.Queue()):
        parallel_state.initialize_model_parallel(tp, 1)
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if owns_group:
                dist.destroy_process_group()


def transformer_config(layers=2, hidden=64, heads=4, groups=2, ffn=96, eps=1e-5, **fields):
    """fields: other TransformerConfig fields (e.g. normalization, add_bias_linear, qk_layernorm)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    return TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                             num_query_groups=groups, ffn_hidden_size=ffn, layernorm_epsilon=eps,
                             use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
                             attention_dropout=0.0, **{**base, **fields})


def build_gpt(tied: bool, vocab=128, max_len=64, rotary_base=10000, **shape):
    """A megatron GPTModel with the local layer spec: RMSNorm, SwiGLU, GQA, RoPE (call inside cpu_megatron)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = transformer_config(**shape)
    spec = get_gpt_layer_local_spec(normalization=cfg.normalization, qk_layernorm=cfg.qk_layernorm)
    return GPTModel(cfg, spec, vocab_size=vocab,
                    max_sequence_length=max_len, position_embedding_type="rope", rotary_base=rotary_base,
                    share_embeddings_and_output_weights=tied)


def build_moe_gpt(experts=4, topk=2, moe_ffn=48, shared=32, vocab=128, max_len=64, layer_freq=1, **shape):
    """MoE layers (local spec: SequentialMLP experts, a shared expert), softmax top-k routing, the
    allgather dispatcher (the alltoall one makes a CUDA stream); layer_freq as megatron's moe_layer_freq
    (a list mixes dense and MoE layers); call inside cpu_megatron."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = dataclasses.replace(transformer_config(**shape), num_moe_experts=experts, moe_router_topk=topk,
                              moe_ffn_hidden_size=moe_ffn, moe_shared_expert_intermediate_size=shared,
                              moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, moe_layer_freq=layer_freq)
    spec = (get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm") if layer_freq == 1 else
            get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm"))
    return GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=max_len, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def moe_args(model) -> argparse.Namespace:
    """megatron_args plus the MoE arguments Megatron-LM saves for build_moe_gpt's model."""
    c = model.config
    args = megatron_args(model, False)
    args.__dict__.update(
        num_experts=c.num_moe_experts, moe_router_topk=c.moe_router_topk, moe_ffn_hidden_size=c.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size, moe_layer_freq=c.moe_layer_freq,
        moe_router_score_function=c.moe_router_score_function, moe_router_pre_softmax=c.moe_router_pre_softmax,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, moe_router_dtype=c.moe_router_dtype,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_shared_expert_gate=c.moe_shared_expert_gate,
        moe_router_enable_expert_bias=c.moe_router_enable_expert_bias,
        moe_router_topk_scaling_factor=c.moe_router_topk_scaling_factor)
    return args


def megatron_args(model, tied: bool, rotary_base=10000, max_len=64) -> argparse.Namespace:
    """The `args` Megatron-LM would save for this model (TransformerConfig names, its argument defaults),
    with one of Megatron's enums and a dtype in it as real runs have."""
    from megatron.core.transformer.enums import AttnBackend

    c = model.config
    return argparse.Namespace(
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        group_query_attention=c.num_query_groups != c.num_attention_heads, num_query_groups=c.num_query_groups,
        kv_channels=c.kv_channels, ffn_hidden_size=c.ffn_hidden_size, padded_vocab_size=model.vocab_size,
        make_vocab_size_divisible_by=128, max_position_embeddings=max_len, position_embedding_type="rope",
        rotary_base=rotary_base, rotary_percent=1.0, rotary_interleaved=False, use_rope_scaling=False,
        normalization=c.normalization, layernorm_epsilon=c.layernorm_epsilon, swiglu=c.gated_linear_unit,
        squared_relu=False, add_bias_linear=c.add_bias_linear, add_qkv_bias=c.add_qkv_bias,
        qk_layernorm=c.qk_layernorm, untie_embeddings_and_output_weights=not tied,
        attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.02, num_experts=None,
        multi_latent_attention=False, mtp_num_layers=None, ckpt_format="torch_dist", transformer_impl="local",
        attention_backend=AttnBackend.auto, params_dtype=torch.float32, seq_length=max_len)


def save_megatron(model, save_dir: Path, args, iteration: int = 7, per_layer: bool = False) -> Path:
    """What Megatron-LM's save_checkpoint writes for torch_dist: SAVE/iter_XXXXXXX + the tracker file.
    per_layer: keys `decoder.layers.<i>.*` (megatron's non-homogeneous layout) instead of stacked ones."""
    from megatron.core import dist_checkpointing

    step = save_dir / f"iter_{iteration:07d}"
    step.mkdir(parents=True, exist_ok=True)  # every rank of a multi-rank save
    sharded = model.sharded_state_dict(metadata={"non_homogeneous_layers": True} if per_layer else None)
    state = {"model": sharded, "args": args, "checkpoint_version": 3.0, "iteration": iteration}
    dist_checkpointing.save(state, str(step))
    if dist.get_rank() == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return step


def load_megatron(model, step_dir: Path) -> dict:
    """dist_checkpointing.load into `model` (strict); returns the common state it read."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(step_dir))
    model.load_state_dict(loaded.pop("model"), strict=True)
    return loaded


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """(batch, seq, vocab) logits of megatron's forward, with an explicit causal mask."""
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True = masked out
    model.eval()
    with torch.no_grad():
        return model(tokens, positions, mask)


def state_tensors(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
            and "_extra_state" not in k}


def full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """logits() with the vocabulary shards of a tensor-parallel output layer gathered: (batch, seq, vocab)."""
    from megatron.core import parallel_state

    local = logits(model, tokens)
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def tp_save(rank: int, world_size: int, save_dir: str) -> dict:
    """run_ranks target: a tensor-parallel GPTModel saved as torch_dist; its gathered logits, local tensors."""
    with cpu_megatron(tp=world_size):
        torch.manual_seed(51)
        model = build_gpt(False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    p.add_(0.1 * torch.randn_like(p))  # the same on every rank: the same seed
        save_megatron(model, Path(save_dir), megatron_args(model, False))
        torch.manual_seed(52)
        tokens = torch.randint(0, 128, (2, 24))
        return {"tokens": tokens, "logits": full_logits(model, tokens), "state": state_tensors(model)}


def tp_load(rank: int, world_size: int, step_dir: str) -> dict:
    """run_ranks target: a fresh tensor-parallel GPTModel loaded from `step_dir`; its local tensors."""
    with cpu_megatron(tp=world_size):
        torch.manual_seed(53)
        model = build_gpt(False)
        load_megatron(model, Path(step_dir))
        return state_tensors(model)
