"""Closed forms of a `GPTModel`: its parameter count and its training FLOPs per token.

Both are sums over the pattern of per-sublayer terms, written from the layer definitions (not by
walking a built model) so the tests can hold them against an actual model for every option. The
registry models/blocks.py:SUBLAYERS picks each symbol's terms.
"""

from __future__ import annotations

import math

from meshtron.config.schema import ModelConfig
from meshtron.nn.mlp import is_gated


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    return int(math.ceil(vocab_size / divisible_by) * divisible_by)


def _norm(cfg: ModelConfig, dim: int) -> int:
    return dim if cfg.normalization == "RMSNorm" else 2 * dim


def attention_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one attention mixer's projections (no biases, norms or sinks)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if cfg.multi_latent_attention:
        q_dim = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        q = d * h * q_dim if cfg.q_lora_rank is None else d * cfg.q_lora_rank + cfg.q_lora_rank * h * q_dim
        kv = d * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_head_dim + cfg.v_head_dim)
        return q + kv + h * cfg.v_head_dim * d
    hd, g = cfg.head_dim, cfg.num_kv_heads
    return d * h * hd + 2 * d * g * hd + h * hd * d


def attention_params(cfg: ModelConfig) -> int:
    """All parameters of one attention mixer."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    total = attention_matmul_params(cfg)
    if cfg.multi_latent_attention:
        if cfg.q_lora_rank is not None:
            total += _norm(cfg, cfg.q_lora_rank) + (cfg.q_lora_rank if cfg.add_qkv_bias else 0)
        total += _norm(cfg, cfg.kv_lora_rank)
        if cfg.add_qkv_bias:
            total += cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
    else:
        if cfg.add_qkv_bias:
            total += (h + 2 * cfg.num_kv_heads) * cfg.head_dim
        if cfg.qk_layernorm:
            total += 2 * _norm(cfg, cfg.head_dim)
    if cfg.attention_output_bias:
        total += d
    if cfg.softmax_type == "learnable":
        total += h
    return total


def mlp_matmul_params(cfg: ModelConfig) -> int:
    return (3 if is_gated(cfg.activation) else 2) * cfg.hidden_size * cfg.ffn_size


def mlp_params(cfg: ModelConfig) -> int:
    total = mlp_matmul_params(cfg)
    if cfg.add_bias_linear:
        total += (2 if is_gated(cfg.activation) else 1) * cfg.ffn_size + cfg.hidden_size
    return total


def moe_matmul_params(cfg: ModelConfig, active: bool) -> int:
    """Matmul weights of one MoE mixer: the router, the shared experts and all routed experts, or
    (active) only the moe_router_topk experts a token uses."""
    gated = 3 if is_gated(cfg.activation) else 2
    experts = cfg.moe_router_topk if active else cfg.num_moe_experts
    total = cfg.hidden_size * cfg.num_moe_experts + experts * gated * cfg.hidden_size * cfg.moe_ffn_size
    shared = cfg.moe_shared_expert_intermediate_size
    if shared:
        total += gated * cfg.hidden_size * shared + (cfg.hidden_size if cfg.moe_shared_expert_gate else 0)
    return total


def moe_active_matmul_params(cfg: ModelConfig) -> int:
    return moe_matmul_params(cfg, active=True)


def moe_params(cfg: ModelConfig) -> int:
    """All parameters of one MoE mixer (expert biases follow add_bias_linear, like the dense MLP)."""
    total = moe_matmul_params(cfg, active=False)
    E, gated, d = cfg.num_moe_experts, is_gated(cfg.activation), cfg.hidden_size
    if cfg.add_bias_linear:
        total += E * ((2 if gated else 1) * cfg.moe_ffn_size + d)
        if cfg.moe_shared_expert_intermediate_size:
            total += (2 if gated else 1) * cfg.moe_shared_expert_intermediate_size + d
    if cfg.moe_router_add_bias:
        total += E
    return total


def mamba_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one Mamba mixer's projections: z, x, B, C, dt in and the output back."""
    d, inner, bc = cfg.hidden_size, cfg.mamba_inner_size, cfg.mamba_num_groups * cfg.mamba_state_dim
    return d * (2 * inner + 2 * bc + cfg.mamba_heads) + inner * d


def mamba_params(cfg: ModelConfig) -> int:
    """All parameters of one Mamba mixer: projections, conv, A_log / D / dt_bias, gated norm."""
    inner, heads, bc = cfg.mamba_inner_size, cfg.mamba_heads, cfg.mamba_num_groups * cfg.mamba_state_dim
    conv_channels = inner + 2 * bc
    total = mamba_matmul_params(cfg) + conv_channels * cfg.mamba_conv_kernel + 3 * heads + inner
    if cfg.mamba_conv_bias:
        total += conv_channels
    if cfg.mamba_proj_bias:
        total += 2 * inner + 2 * bc + heads + cfg.hidden_size  # the five in-projections and out_proj
    return total


def mamba_scan_flops(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token of one Mamba mixer outside its projections (3x the forward):
    the conv (2 K per channel), the in-chunk scores C.B (2 L N per group) and their product with x
    (2 L P per head), the chunk states and their read-out (2 x 2 P N per head). No causal halving."""
    chunk = min(cfg.mamba_chunk_size, seq_length)
    g, n, h, p = cfg.mamba_num_groups, cfg.mamba_state_dim, cfg.mamba_heads, cfg.mamba_head_dim
    conv = 2 * cfg.mamba_conv_kernel * (h * p + 2 * g * n)
    return 3.0 * (conv + 2 * chunk * g * n + 2 * chunk * h * p + 4 * h * p * n)


def count_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Closed-form parameter count of `GPTModel(cfg, vocab_size)` (vocab already padded or not)."""
    from meshtron.models.blocks import SUBLAYERS  # it imports this module's closed forms

    v = padded_vocab_size(cfg.vocab_size or vocab_size, cfg.make_vocab_size_divisible_by)
    d = cfg.hidden_size
    norm = _norm(cfg, d)
    attn, mlp = attention_params(cfg), mlp_params(cfg)
    total = v * d + norm  # embedding + final norm
    if cfg.position_embedding_type == "learned_absolute":
        total += cfg.max_position_embeddings * d
    if not cfg.tie_word_embeddings:
        total += v * d
    for s in cfg.pattern:
        total += norm + SUBLAYERS[s].params(cfg)
    # each MTP depth: two input norms, the 2d -> d projection, an attention and an MLP sublayer, a final norm
    total += cfg.mtp_num_layers * (2 * norm + 2 * d * d + (norm + attn) + (norm + mlp) + norm)
    return total


def _attention_score_flops(cfg: ModelConfig, seq_length: int, window: bool) -> float:
    """Training FLOPs per token of q k^T and p v in one attention layer (no causal halving)."""
    keys = min(seq_length, cfg.window_size) if window and cfg.window_size is not None else seq_length
    h = cfg.num_attention_heads
    if cfg.multi_latent_attention:
        return 6.0 * keys * h * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim)
    return 12.0 * keys * h * cfg.head_dim


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), PaLM-style accounting.

    forward = 2 * P_matmul + sum over attention sublayers of 2 * keys * heads * (qk_dim + v_dim)
    where P_matmul counts every weight used in a matmul (sublayer projections and the output head,
    not the embedding lookup; of an MoE sublayer the router, shared experts and top-k experts), and
    keys is the sequence length (the window for windowed layers; no halving for causality). With head_dim for both qk and v this is the familiar
    training = 6 * P_matmul + 12 * n_attn * seq * heads * head_dim. Mamba sublayers add their scan
    (`mamba_scan_flops`). MTP depths add their projection, sublayers and one more pass through the
    output head.
    """
    from meshtron.models.blocks import SUBLAYERS

    v = padded_vocab_size(cfg.vocab_size or vocab_size, cfg.make_vocab_size_divisible_by)
    d = cfg.hidden_size
    attn_w, mlp_w = attention_matmul_params(cfg), mlp_matmul_params(cfg)
    matmul_params = v * d + sum(SUBLAYERS[s].matmul_params(cfg) for s in cfg.pattern)
    matmul_params += cfg.mtp_num_layers * (2 * d * d + attn_w + mlp_w + v * d)
    flops = 6.0 * matmul_params + cfg.pattern.count("M") * mamba_scan_flops(cfg, seq_length)
    for i in range(cfg.pattern.count("*")):
        flops += _attention_score_flops(cfg, seq_length, cfg.is_window_layer(i))
    every_window = cfg.window_size is not None and all(cfg.is_window_layer(i) for i in range(cfg.pattern.count("*")))
    flops += cfg.mtp_num_layers * _attention_score_flops(cfg, seq_length, every_window)
    return flops
