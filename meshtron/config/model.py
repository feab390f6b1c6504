"""The model section of the run configuration: `ModelConfig`, the architecture (layer pattern,
attention, positions, MLP, MoE, Mamba, multi-token prediction). Re-exported by `schema`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from meshtron.config.fields import ConfigError, check, option
from meshtron.config.hybrid import LAYER_SYMBOLS, check_pattern, pattern_from_ratios
from meshtron.config.registry import ROUTER_REGISTRY


@dataclass(kw_only=True)
class ModelConfig:
    """The network: layer pattern, widths, attention, positions, MLP, Mamba, initialisation."""

    layer_pattern: str = option("", "Sublayer symbols in order: '*' attention, '-' MLP, 'M' Mamba-2, 'E' MoE; empty derives "
                                    "it from hybrid_num_sublayers and the ratios, else '*-' * num_layers ('*E' for the MoE layers of moe_layer_freq)")
    num_layers: int = option(4, "Transformer layers (attention + MLP) when layer_pattern is empty")
    hybrid_num_sublayers: Optional[int] = option(
        None, "Hybrid: total sublayers of a pattern derived from hybrid_attention_ratio and hybrid_mlp_ratio (the "
              "rest Mamba 'M'); a given layer_pattern overrides it and must have this length; null: no hybrid")
    hybrid_attention_ratio: float = option(0.0, "Hybrid: fraction of the sublayers that are attention, spread evenly")
    hybrid_mlp_ratio: float = option(0.0, "Hybrid: fraction of the sublayers that are MLP, spread evenly")
    hidden_size: int = option(256, "Model width")
    num_attention_heads: int = option(4, "Query heads per attention sublayer")
    num_query_groups: Optional[int] = option(None, "Key/value heads for GQA/MQA; null means one per query head")
    kv_channels: Optional[int] = option(None, "Head dimension; null means hidden_size / num_attention_heads")
    ffn_hidden_size: Optional[int] = option(None, "MLP inner width; null means 4 * hidden_size")
    vocab_size: Optional[int] = option(None, "Vocabulary size; null takes the tokenizer's size")
    make_vocab_size_divisible_by: int = option(128, "Pad the vocabulary to a multiple of this (faster matmuls)")
    max_position_embeddings: int = option(2048, "Longest sequence the model supports")
    position_embedding_type: Literal["rope", "yarn", "learned_absolute", "none"] = option(
        "rope", "How positions enter the model: rope, yarn (RoPE with YaRN scaling), learned_absolute, none")
    rotary_base: float = option(10000.0, "RoPE theta")
    rotary_percent: float = option(1.0, "Fraction of each head's dimensions that RoPE rotates (the first ones)")
    rotary_interleaved: bool = option(False, "RoPE rotates adjacent pairs (x0,x1),(x2,x3).. instead of the two halves")
    rope_scaling: bool = option(False, "Frequency scaling of RoPE, Llama-3 or linear (rope_scaling_type; position_embedding_type rope)")
    rope_scaling_factor: float = option(8.0, "RoPE scaling: Llama-3 divides the low frequencies by this, linear all of them")
    rope_scaling_low_freq_factor: float = option(1.0, "Llama-3 scaling: wavelengths above original/low are scaled")
    rope_scaling_high_freq_factor: float = option(4.0, "Llama-3 scaling: wavelengths below original/high are kept")
    rope_scaling_original_max_position_embeddings: int = option(8192, "Llama-3 scaling: pre-training context length")
    yarn_rotary_scaling_factor: float = option(1.0, "YaRN: context extension factor s (interpolated dims divide by s)")
    yarn_original_max_position_embeddings: int = option(4096, "YaRN: pre-training context length")
    yarn_beta_fast: float = option(32.0, "YaRN: dims rotating more than this many times are extrapolated (kept)")
    yarn_beta_slow: float = option(1.0, "YaRN: dims rotating fewer than this many times are fully interpolated")
    yarn_mscale: float = option(1.0, "YaRN: cos/sin scale is mscale(s, yarn_mscale) / mscale(s, yarn_mscale_all_dim)")
    yarn_mscale_all_dim: float = option(0.0, "YaRN: also multiplies the softmax scale by mscale(s, this)^2")
    correction_range_round_to_int: bool = option(True, "YaRN: round the correction range to whole dimensions")
    normalization: Literal["RMSNorm", "LayerNorm"] = option("RMSNorm", "Norm before every sublayer and at the end")
    norm_epsilon: float = option(1e-5, "Epsilon of the norms")
    activation: Literal["swiglu", "geglu", "geglu_tanh", "quick_geglu", "gelu", "gelu_tanh", "quick_gelu",
                        "squared_relu"] = option("swiglu", "MLP activation; the *glu* ones are gated (three matrices)")
    activation_func_clamp_value: Optional[float] = option(
        None, "Gated MLPs: clamp the gate to <= c and the linear branch to [-c, c] (GPT-OSS uses 7.0)")
    glu_linear_offset: float = option(0.0, "Gated MLPs: act(gate) * (linear + offset) (GPT-OSS uses 1.0)")
    add_bias_linear: bool = option(False, "Biases in the MLP linear layers (and the attention output unless "
                                          "add_bias_attention_output says otherwise)")
    add_qkv_bias: bool = option(False, "Biases in the query/key/value projection")
    qk_layernorm: bool = option(False, "Normalise each query and key head (model.normalization) before RoPE")
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = option(
        "vanilla", "Attention softmax: vanilla, off-by-one (a virtual sink logit 0), learnable (a sink logit per head)")
    softmax_scale: Optional[float] = option(None, "Attention logit scale; null means 1/sqrt(query-key head dim)")
    window_size: Optional[int] = option(None, "Sliding-window attention: a token sees itself and the window_size-1 "
                                              "tokens before it; null means full causal attention")
    window_attn_skip_freq: Union[int, list[int], None] = option(
        None, "With window_size: N makes every N-th attention layer full (1-based); a list gives each attention "
              "layer 1 (window) or 0 (full); null windows every layer")
    multi_latent_attention: bool = option(False, "Multi-latent attention (DeepSeek-V2/V3) instead of GQA")
    q_lora_rank: Optional[int] = option(None, "MLA: query latent rank; null projects queries directly")
    kv_lora_rank: int = option(512, "MLA: key/value latent rank")
    qk_head_dim: int = option(128, "MLA: per-head query/key dims without position")
    qk_pos_emb_head_dim: int = option(64, "MLA: per-head query/key dims that carry RoPE (key part shared by heads)")
    v_head_dim: int = option(128, "MLA: per-head value dims")
    tie_word_embeddings: bool = option(False, "Share the input embedding with the output head")
    mtp_num_layers: int = option(0, "Multi-token prediction depths (DeepSeek-V3); depth k predicts token t+k+1")
    mtp_loss_scaling_factor: float = option(0.1, "MTP: loss weight; the total adds factor / mtp_num_layers * sum of depth losses")
    mamba_num_heads: Optional[int] = option(None, "Mamba: SSM heads; null means mamba_expand * hidden_size / mamba_head_dim")
    mamba_expand: int = option(2, "Mamba: inner width is mamba_expand * hidden_size when mamba_num_heads is null")
    mamba_head_dim: int = option(64, "Mamba: channels per SSM head (P)")
    mamba_num_groups: int = option(8, "Mamba: groups of heads sharing B and C (and one gated-norm group each)")
    mamba_state_dim: int = option(128, "Mamba: SSM state size per channel (N)")
    mamba_conv_kernel: int = option(4, "Mamba: width of the causal depthwise convolution")
    mamba_conv_bias: bool = option(True, "Mamba: bias in the convolution")
    mamba_proj_bias: bool = option(False, "Mamba: biases in the input and output projections")
    mamba_chunk_size: int = option(128, "Mamba: SSD chunk length (quadratic inside a chunk, recurrent across)")
    mamba_dt_min: float = option(0.001, "Mamba: init of dt_bias draws dt log-uniformly from [dt_min, dt_max]")
    mamba_dt_max: float = option(0.1, "Mamba: upper end of the dt init range")
    mamba_dt_init_floor: float = option(1e-4, "Mamba: the dt init is clamped to at least this")
    mamba_dt_limit_min: float = option(0.0, "Mamba: dt = softplus(. + dt_bias) is clamped to [dt_limit_min, dt_limit_max]")
    mamba_dt_limit_max: float = option(float("inf"), "Mamba: upper dt clamp (inf: none)")
    mamba_recompute_scan: bool = option(
        True, "Mamba: keep only the SSD scan's inputs for backward and recompute its chunk matrices there "
              "(about half a Mamba sublayer's activation memory for ~15% more of its time)")
    init_method_std: float = option(0.02, "Std of the normal init of weights")
    scaled_init: bool = option(True, "Scale output-projection init by 1/sqrt(2 * num_layers)")
    attention_dropout: float = option(0.0, "Dropout on attention probabilities")
    hidden_dropout: float = option(0.0, "Dropout on each sublayer's output before the residual add")
    # ---- mixture of experts (docs/moe.md); Megatron-LM names -----------------------------------
    num_moe_experts: Optional[int] = option(None, "Routed experts per MoE sublayer ('E'); null: no MoE")
    moe_layer_freq: Union[int, list[int]] = option(
        1, "Derived pattern: N makes every N-th layer MoE (layers 0, N, 2N..); a list gives each layer 1 (MoE) or "
           "0 (dense), e.g. DeepSeek's dense first layers")
    moe_ffn_hidden_size: Optional[int] = option(None, "Inner width of each routed expert; null means ffn_hidden_size")
    moe_shared_expert_intermediate_size: Optional[int] = option(
        None, "Inner width of the shared experts (one MLP every token passes through); null: none")
    moe_shared_expert_gate: bool = option(False, "Scale the shared experts' output by sigmoid(x w) (Qwen2-MoE)")
    moe_router_type: str = option(
        "topk", "Router by name: built-in, registered (meshtron.nn.moe.register_router), or an entry point in "
        "group meshtron.routers")
    moe_router_topk: int = option(2, "Experts per token")
    moe_router_score_function: Literal["softmax", "sigmoid"] = option("softmax", "Router score function")
    moe_router_pre_softmax: bool = option(
        False, "Softmax: pick the top-k of the softmax over all experts and keep those weights; false: softmax "
               "over the k picked logits (weights sum to 1)")
    moe_router_topk_scaling_factor: Optional[float] = option(None, "Multiply the top-k weights by this (DeepSeek-V3: 2.5)")
    moe_router_num_groups: Optional[int] = option(None, "Group-limited routing: expert groups (DeepSeek n_group)")
    moe_router_group_topk: Optional[int] = option(None, "Group-limited routing: groups a token may use (topk_group)")
    moe_router_dtype: Literal["fp32", "input"] = option("fp32", "Router logits and scores in fp32, or the input dtype")
    moe_router_add_bias: bool = option(False, "A learned bias in the router's linear layer (GPT-OSS)")
    moe_input_jitter_eps: Optional[float] = option(
        None, "Training: multiply router inputs by uniform noise in [1-eps, 1+eps] (input dtype); null: off")
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = option(
        "aux_loss", "Balancing loss: over the micro-batch (aux_loss), per sequence (seq_aux_loss, DeepSeek-V3), none")
    moe_aux_loss_coeff: float = option(0.01, "Weight of the load-balancing loss (0 disables it)")
    moe_z_loss_coeff: Optional[float] = option(None, "Weight of the router z-loss mean(logsumexp(logits)^2); null: off")
    moe_router_enable_expert_bias: bool = option(
        False, "Auxiliary-loss-free balancing: a per-expert bias added to the scores when picking, updated each step")
    moe_router_bias_update_rate: float = option(1e-3, "Expert bias step: bias += rate * sign(mean load - load)")
    moe_expert_capacity_factor: Optional[float] = option(
        None, "Capacity per expert = ceil(tokens * topk / experts * factor); excess choices are dropped; null: dropless")
    moe_token_drop_policy: Literal["probs", "position"] = option(
        "probs", "Over capacity, keep the highest-probability tokens (probs) or the earliest (position)")
    moe_router_padding_for_quantization: bool = option(
        False, "Pad the routing map so each expert's token count is a multiple of moe_router_padding_alignment")
    moe_router_padding_alignment: int = option(16, "Alignment of expert token counts when padding (16/32/64/128)")
    moe_grouped_gemm: bool = option(True, "Experts as grouped GEMMs (torch._grouped_mm) where supported; else a loop")
    attention_backend: Literal["auto", "sdpa", "flex"] = option(
        "auto", "Full-sequence attention kernel: auto (FlexAttention on CUDA for documents, windows or sinks "
                "without attention dropout; SDPA otherwise and on a CPU), sdpa, flex (docs/models.md)")
    rope_scaling_type: Literal["llama3", "linear"] = option(
        "llama3", "With rope_scaling: llama3 (frequency bands) or linear (every frequency divided by "
                  "rope_scaling_factor: position interpolation)")
    add_bias_attention_output: Optional[bool] = option(
        None, "Bias in the attention output projection; null follows add_bias_linear (Qwen3/Llama attention_bias "
              "without MLP biases: true here, add_bias_linear false)")

    @property
    def pattern(self) -> str:
        if self.layer_pattern:
            return self.layer_pattern
        if self.hybrid_num_sublayers:
            return pattern_from_ratios(self.hybrid_num_sublayers, self.hybrid_attention_ratio, self.hybrid_mlp_ratio)
        if self.num_moe_experts is None:
            return "*-" * self.num_layers
        return "".join("*E" if self.is_moe_layer(i) else "*-" for i in range(self.num_layers))

    @property
    def mamba_heads(self) -> int:
        return self.mamba_num_heads or self.mamba_expand * self.hidden_size // self.mamba_head_dim

    @property
    def mamba_inner_size(self) -> int:
        """Channels of the SSM input x, the gate z and the gated norm: heads x head_dim."""
        return self.mamba_heads * self.mamba_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether derived layer `layer` (0-based) gets an MoE sublayer under moe_layer_freq."""
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return layer % freq == 0
        return bool(freq[layer])

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def num_transformer_layers(self) -> int:
        """Depth used by scaled init: the number of sequence mixers, attention and Mamba (at least 1)."""
        return max(1, self.pattern.count("*") + self.pattern.count("M"))

    @property
    def attention_output_bias(self) -> bool:
        """Whether the attention output projection has a bias (add_bias_attention_output, else add_bias_linear)."""
        return self.add_bias_linear if self.add_bias_attention_output is None else self.add_bias_attention_output

    @property
    def uses_rope(self) -> bool:
        return self.position_embedding_type in ("rope", "yarn")

    @property
    def rotary_dim(self) -> int:
        """Dimensions RoPE rotates per head: MLA's position part, else a fraction of the head."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)

    def is_window_layer(self, attention_index: int) -> bool:
        """Whether the attention sublayer number `attention_index` (0-based, counting '*' only) is windowed."""
        if self.window_size is None:
            return False
        skip = self.window_attn_skip_freq
        if skip is None:
            return True
        if isinstance(skip, int):
            return (attention_index + 1) % skip != 0
        return bool(skip[attention_index])

    def validate(self) -> None:
        self._validate_hybrid()
        check_pattern(self.pattern, LAYER_SYMBOLS)
        check(self.num_layers >= 1, "model.num_layers", self.num_layers, "must be >= 1")
        check(self.hidden_size >= 1, "model.hidden_size", self.hidden_size, "must be >= 1")
        check(self.num_attention_heads >= 1, "model.num_attention_heads", self.num_attention_heads, "must be >= 1")
        if self.kv_channels is None and not self.multi_latent_attention:
            check(self.hidden_size % self.num_attention_heads == 0, "model.num_attention_heads",
                  self.num_attention_heads, f"must divide hidden_size={self.hidden_size} (or set model.kv_channels)")
        check(self.num_attention_heads % self.num_kv_heads == 0, "model.num_query_groups", self.num_query_groups,
              f"must divide num_attention_heads={self.num_attention_heads}")
        for name in ("num_query_groups", "kv_channels", "ffn_hidden_size", "vocab_size"):
            v = getattr(self, name)
            check(v is None or v >= 1, f"model.{name}", v, "must be >= 1 or null")
        check(self.max_position_embeddings >= 1, "model.max_position_embeddings", self.max_position_embeddings, "must be >= 1")
        check(self.make_vocab_size_divisible_by >= 1, "model.make_vocab_size_divisible_by",
              self.make_vocab_size_divisible_by, "must be >= 1")
        for name in ("attention_dropout", "hidden_dropout"):
            v = getattr(self, name)
            check(0.0 <= v < 1.0, f"model.{name}", v, "must be in [0, 1)")
        check(self.init_method_std > 0, "model.init_method_std", self.init_method_std, "must be > 0")
        check(self.norm_epsilon > 0, "model.norm_epsilon", self.norm_epsilon, "must be > 0")
        self._validate_positions()
        self._validate_mamba()
        self._validate_attention()
        self._validate_mlp_and_mtp()
        self._validate_moe()

    def _validate_hybrid(self) -> None:
        n = self.hybrid_num_sublayers
        for name in ("hybrid_attention_ratio", "hybrid_mlp_ratio"):
            v = getattr(self, name)
            check(0.0 <= v <= 1.0, f"model.{name}", v, "must be in [0, 1]")
        if n is None:
            return
        check(n >= 1, "model.hybrid_num_sublayers", n, "must be >= 1 or null")
        counts = round(n * self.hybrid_attention_ratio), round(n * self.hybrid_mlp_ratio)
        check(sum(counts) <= n, "model.hybrid_mlp_ratio", self.hybrid_mlp_ratio,
              f"with hybrid_attention_ratio={self.hybrid_attention_ratio} it asks for {counts[0]} attention + "
              f"{counts[1]} MLP sublayers, more than hybrid_num_sublayers={n}; lower a ratio")
        check(not self.layer_pattern or len(self.layer_pattern) == n, "model.layer_pattern", self.layer_pattern,
              f"has {len(self.layer_pattern)} sublayers but hybrid_num_sublayers={n}; make them agree or set one null")

    def _validate_mamba(self) -> None:
        if "M" not in self.pattern:
            return
        for name in ("mamba_head_dim", "mamba_num_groups", "mamba_state_dim", "mamba_conv_kernel", "mamba_chunk_size",
                     "mamba_expand"):
            check(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), "must be >= 1")
        if self.mamba_num_heads is None:
            inner = self.mamba_expand * self.hidden_size
            check(inner % self.mamba_head_dim == 0, "model.mamba_head_dim", self.mamba_head_dim,
                  f"must divide mamba_expand * hidden_size = {inner} (or set model.mamba_num_heads)")
        else:
            check(self.mamba_num_heads >= 1, "model.mamba_num_heads", self.mamba_num_heads, "must be >= 1 or null")
        check(self.mamba_heads % self.mamba_num_groups == 0, "model.mamba_num_groups", self.mamba_num_groups,
              f"must divide the {self.mamba_heads} Mamba heads")
        check(0 < self.mamba_dt_min <= self.mamba_dt_max, "model.mamba_dt_min", self.mamba_dt_min,
              f"must be > 0 and <= mamba_dt_max={self.mamba_dt_max}")
        check(self.mamba_dt_init_floor >= 0, "model.mamba_dt_init_floor", self.mamba_dt_init_floor, "must be >= 0")
        check(0 <= self.mamba_dt_limit_min < self.mamba_dt_limit_max, "model.mamba_dt_limit_min",
              self.mamba_dt_limit_min, f"must be >= 0 and < mamba_dt_limit_max={self.mamba_dt_limit_max}")

    def _validate_positions(self) -> None:
        check(0.0 < self.rotary_percent <= 1.0, "model.rotary_percent", self.rotary_percent, "must be in (0, 1]")
        check(self.rotary_base > 0, "model.rotary_base", self.rotary_base, "must be > 0 (RoPE theta, e.g. 10000)")
        if self.uses_rope:
            field = "model.qk_pos_emb_head_dim" if self.multi_latent_attention else "model.rotary_percent"
            check(self.rotary_dim >= 2 and self.rotary_dim % 2 == 0, field, self.rotary_dim,
                  "RoPE needs an even number (>= 2) of rotated dimensions per head")
        check(not self.rope_scaling or self.position_embedding_type == "rope", "model.rope_scaling", self.rope_scaling,
              "Llama-3 and linear scaling need position_embedding_type rope (YaRN is position_embedding_type yarn)")
        if self.rope_scaling:
            check(self.rope_scaling_factor > 0, "model.rope_scaling_factor", self.rope_scaling_factor, "must be > 0")
        if self.rope_scaling and self.rope_scaling_type == "llama3":
            check(self.rope_scaling_high_freq_factor > self.rope_scaling_low_freq_factor > 0,
                  "model.rope_scaling_high_freq_factor", self.rope_scaling_high_freq_factor,
                  f"must be > rope_scaling_low_freq_factor={self.rope_scaling_low_freq_factor} > 0")
            check(self.rope_scaling_original_max_position_embeddings >= 1,
                  "model.rope_scaling_original_max_position_embeddings",
                  self.rope_scaling_original_max_position_embeddings, "must be >= 1")
        check(self.yarn_rotary_scaling_factor > 0, "model.yarn_rotary_scaling_factor", self.yarn_rotary_scaling_factor,
              "must be > 0")
        check(self.yarn_original_max_position_embeddings >= 1, "model.yarn_original_max_position_embeddings",
              self.yarn_original_max_position_embeddings, "must be >= 1")
        check(self.yarn_beta_fast > 0 and self.yarn_beta_slow > 0, "model.yarn_beta_slow", self.yarn_beta_slow,
              "yarn_beta_fast and yarn_beta_slow must be > 0")
        for name in ("yarn_mscale", "yarn_mscale_all_dim"):
            check(getattr(self, name) >= 0, f"model.{name}", getattr(self, name), "must be >= 0")

    def _validate_attention(self) -> None:
        if self.softmax_scale is not None:
            check(self.softmax_scale > 0, "model.softmax_scale", self.softmax_scale, "must be > 0 or null")
        if self.window_size is not None:
            check(self.window_size >= 1, "model.window_size", self.window_size, "must be >= 1 or null")
        skip = self.window_attn_skip_freq
        if isinstance(skip, int):
            check(skip >= 1, "model.window_attn_skip_freq", skip, "must be >= 1, a list of 0/1, or null")
        elif isinstance(skip, list):
            n = self.pattern.count("*")
            check(len(skip) == n and all(v in (0, 1) for v in skip), "model.window_attn_skip_freq", skip,
                  f"give one 0 (full) or 1 (window) per attention layer ({n} of them)")
        check(self.attention_backend != "flex" or self.attention_dropout == 0, "model.attention_backend",
              self.attention_backend, "flex has no attention dropout; set model.attention_dropout 0 or use auto "
                                      "(it keeps SDPA when dropout is on)")
        if self.multi_latent_attention:
            check(not self.qk_layernorm, "model.qk_layernorm", self.qk_layernorm,
                  "multi_latent_attention always normalises its latents; set qk_layernorm false")
            for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                check(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), "must be >= 1")
            if self.q_lora_rank is not None:
                check(self.q_lora_rank >= 1, "model.q_lora_rank", self.q_lora_rank, "must be >= 1 or null")

    def _validate_mlp_and_mtp(self) -> None:
        gated = "glu" in self.activation  # swiglu, geglu, geglu_tanh, quick_geglu
        if self.activation_func_clamp_value is not None:
            check(gated and self.activation_func_clamp_value > 0, "model.activation_func_clamp_value",
                  self.activation_func_clamp_value, "must be > 0 and needs a gated activation (a *glu* one)")
        check(self.glu_linear_offset == 0.0 or gated, "model.glu_linear_offset", self.glu_linear_offset,
              "needs a gated activation (*glu)")
        check(self.mtp_num_layers >= 0, "model.mtp_num_layers", self.mtp_num_layers, "must be >= 0")
        check(self.mtp_loss_scaling_factor >= 0, "model.mtp_loss_scaling_factor", self.mtp_loss_scaling_factor,
              "must be >= 0")

    def _validate_moe(self) -> None:
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            check(freq >= 1, "model.moe_layer_freq", freq, "must be >= 1 or a list of 0/1 per layer")
        elif not self.layer_pattern:
            check(len(freq) == self.num_layers and all(v in (0, 1) for v in freq), "model.moe_layer_freq", freq,
                  f"give one 0 (dense) or 1 (MoE) per layer ({self.num_layers} of them)")
        E = self.num_moe_experts
        if E is None:
            check("E" not in self.pattern, "model.num_moe_experts", E, "'E' in the layer pattern needs the number of experts")
            return
        check(E >= 1, "model.num_moe_experts", E, "must be >= 1 or null")
        if not ROUTER_REGISTRY.knows(self.moe_router_type):
            raise ConfigError(ROUTER_REGISTRY.unknown_message(self.moe_router_type))
        check(1 <= self.moe_router_topk <= E, "model.moe_router_topk", self.moe_router_topk,
              f"must be in [1, num_moe_experts={E}]")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            v = getattr(self, name)
            check(v is None or v >= 1, f"model.{name}", v, "must be >= 1 or null")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        check((groups is None) == (group_topk is None), "model.moe_router_group_topk", group_topk,
              "set moe_router_num_groups and moe_router_group_topk together (or neither)")
        if groups is not None:
            check(groups >= 1 and E % groups == 0, "model.moe_router_num_groups", groups,
                  f"must divide num_moe_experts={E}")
            check(1 <= group_topk <= groups and self.moe_router_topk % group_topk == 0, "model.moe_router_group_topk",
                  group_topk, f"must be in [1, moe_router_num_groups={groups}] and divide moe_router_topk")
            check(self.moe_router_topk <= group_topk * (E // groups), "model.moe_router_topk", self.moe_router_topk,
                  "exceeds the experts of the eligible groups (group_topk * experts per group)")
        if self.moe_router_topk_scaling_factor is not None:
            check(self.moe_router_topk_scaling_factor > 0, "model.moe_router_topk_scaling_factor",
                  self.moe_router_topk_scaling_factor, "must be > 0 or null")
        if self.moe_input_jitter_eps is not None:
            check(0 < self.moe_input_jitter_eps < 1, "model.moe_input_jitter_eps", self.moe_input_jitter_eps,
                  "must be in (0, 1) or null")
        check(self.moe_aux_loss_coeff >= 0, "model.moe_aux_loss_coeff", self.moe_aux_loss_coeff, "must be >= 0")
        if self.moe_z_loss_coeff is not None:
            check(self.moe_z_loss_coeff >= 0, "model.moe_z_loss_coeff", self.moe_z_loss_coeff, "must be >= 0 or null")
        check(self.moe_router_bias_update_rate >= 0, "model.moe_router_bias_update_rate",
              self.moe_router_bias_update_rate, "must be >= 0")
        if self.moe_expert_capacity_factor is not None:
            check(self.moe_expert_capacity_factor > 0, "model.moe_expert_capacity_factor",
                  self.moe_expert_capacity_factor, "must be > 0 or null (dropless)")
        check(self.moe_router_padding_alignment >= 1, "model.moe_router_padding_alignment",
              self.moe_router_padding_alignment, "must be >= 1")
