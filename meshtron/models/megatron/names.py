"""How Megatron Core names what meshtron names: run arguments and tensors.

Arguments: Megatron-LM saves its argparse namespace (`args`) in a checkpoint's common state; most
attributes are TransformerConfig field names, and `ModelConfig` uses the same names where it can.
`ARGUMENTS` lists every ModelConfig field that has a Megatron argument (docs/megatron.md is generated
from it); `model_config_from_args` and `args_from_model_config` are the two directions.

Tensors: a GPTModel decoder layer i is meshtron's sublayers 2i (attention) and 2i+1 (MLP). On disk a
per-layer tensor `decoder.layers.<name>` is stacked over layers on a leading axis (one DCP chunk per
layer), or stored per layer as `decoder.layers.<i>.<name>`. Norms are stored with Transformer Engine
names (`linear_qkv.layer_norm_weight`): the local spec maps its separate `input_layernorm` to them
when it saves; the local names are read too. `linear_qkv` rows are grouped per query group:
[q heads of group g, k_g, v_g] for g in groups; `linear_fc1` rows are [gate; up] in a gated MLP.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

from meshtron.config.schema import ModelConfig


class MegatronError(ValueError):
    """A checkpoint or config that cannot be converted; one line naming the file, tensor or argument."""


# ---- arguments ---------------------------------------------------------------------------------

# field: (Megatron argument attribute, note). The attribute is what `args` holds in the checkpoint;
# the command-line flag is the attribute with dashes unless the note says otherwise.
ARGUMENTS: dict[str, tuple[str, str]] = {
    "num_layers": ("num_layers", ""),
    "hidden_size": ("hidden_size", ""),
    "num_attention_heads": ("num_attention_heads", ""),
    "num_query_groups": ("num_query_groups", "only with `group_query_attention` (`--group-query-attention`)"),
    "kv_channels": ("kv_channels", "null when it equals hidden_size / num_attention_heads"),
    "ffn_hidden_size": ("ffn_hidden_size", ""),
    "vocab_size": ("padded_vocab_size", "the embedding's rows (Megatron pads the tokenizer's size)"),
    "make_vocab_size_divisible_by": ("make_vocab_size_divisible_by", "converted checkpoints use 1: the rows are "
                                     "already padded"),
    "max_position_embeddings": ("max_position_embeddings", ""),
    "position_embedding_type": ("position_embedding_type", "rope and none convert"),
    "rotary_base": ("rotary_base", ""),
    "rotary_percent": ("rotary_percent", ""),
    "rotary_interleaved": ("rotary_interleaved", ""),
    "rope_scaling": ("use_rope_scaling", "`--use-rope-scaling`"),
    "rope_scaling_factor": ("rope_scaling_factor", ""),
    "normalization": ("normalization", ""),
    "norm_epsilon": ("layernorm_epsilon", "older Megatron-LM: `norm_epsilon`"),
    "activation": ("swiglu", "`--swiglu` is swiglu, `--squared-relu` squared_relu, neither gelu"),
    "add_bias_linear": ("add_bias_linear", "`--disable-bias-linear` sets it false"),
    "add_qkv_bias": ("add_qkv_bias", ""),
    "qk_layernorm": ("qk_layernorm", ""),
    "tie_word_embeddings": ("untie_embeddings_and_output_weights", "negated"),
    "attention_dropout": ("attention_dropout", ""),
    "hidden_dropout": ("hidden_dropout", ""),
    "init_method_std": ("init_method_std", ""),
    "num_moe_experts": ("num_experts", ""),
    "moe_layer_freq": ("moe_layer_freq", "an integer N (layers 0, N, 2N.. are MoE) or a 0/1 list per layer"),
    "moe_ffn_hidden_size": ("moe_ffn_hidden_size", ""),
    "moe_shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size", ""),
    "moe_shared_expert_gate": ("moe_shared_expert_gate", ""),
    "moe_router_topk": ("moe_router_topk", ""),
    "moe_router_score_function": ("moe_router_score_function", ""),
    "moe_router_pre_softmax": ("moe_router_pre_softmax", ""),
    "moe_router_topk_scaling_factor": ("moe_router_topk_scaling_factor", ""),
    "moe_router_num_groups": ("moe_router_num_groups", ""),
    "moe_router_group_topk": ("moe_router_group_topk", ""),
    "moe_router_dtype": ("moe_router_dtype", "Megatron's null (the input dtype) is `input`; fp64 is refused"),
    "moe_input_jitter_eps": ("moe_input_jitter_eps", ""),
    "moe_router_load_balancing_type": ("moe_router_load_balancing_type", "global_aux_loss reads as aux_loss; "
                                       "sinkhorn is refused"),
    "moe_aux_loss_coeff": ("moe_aux_loss_coeff", ""),
    "moe_z_loss_coeff": ("moe_z_loss_coeff", ""),
    "moe_router_enable_expert_bias": ("moe_router_enable_expert_bias", ""),
    "moe_router_bias_update_rate": ("moe_router_bias_update_rate", ""),
    "moe_expert_capacity_factor": ("moe_expert_capacity_factor", ""),
    "moe_token_drop_policy": ("moe_token_drop_policy", ""),
    "moe_grouped_gemm": ("moe_grouped_gemm", ""),
}
_MOE_COPIED = ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_topk",
               "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
               "moe_router_num_groups", "moe_router_group_topk", "moe_input_jitter_eps", "moe_aux_loss_coeff",
               "moe_z_loss_coeff", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
               "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_grouped_gemm")

_COPIED = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
           "rotary_base", "rotary_percent", "rotary_interleaved", "rope_scaling_factor", "normalization",
           "add_bias_linear", "add_qkv_bias", "qk_layernorm", "attention_dropout", "hidden_dropout", "init_method_std")

# Arguments that change the tensors or the math in ways the converter does not carry: (attribute, refused when)
_REFUSED = {
    "moe_use_legacy_grouped_gemm": "the legacy grouped-GEMM expert layout",
    "moe_router_bias": "a bias in the router's linear layer",
    "multi_latent_attention": "multi-latent attention",
    "mtp_num_layers": "multi-token prediction layers",
    "hybrid_override_pattern": "a hybrid (Mamba) layer pattern",
    "hybrid_layer_pattern": "a hybrid (Mamba) layer pattern",
    "heterogeneous_layers_config_path": "heterogeneous layers",
    "apply_layernorm_1p": "zero-centred norm weights (apply_layernorm_1p)",
    "window_size": "sliding-window attention",
    "quick_geglu": "the quick-GeGLU activation",
    "qk_l2_norm": "L2 query/key normalisation",
    "moe_latent_size": "MoE latent projections",
}


def _arg(args: dict[str, Any], name: str, default: Any = None) -> Any:
    value = args.get(name, default)
    return default if value is None else value


def model_config_from_args(args: dict[str, Any], vocab_size: int) -> ModelConfig:
    """The ModelConfig a Megatron-LM run's `args` describe; unsupported features are refused by name."""
    for name, what in _REFUSED.items():
        if args.get(name) not in (None, False, 0, "", "none"):
            raise MegatronError(f"args.{name} = {args[name]!r}: the checkpoint uses {what}, which "
                                "`meshtron convert megatron-to-meshtron` does not convert")
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads") if args.get(n) is None]
    if missing:
        raise MegatronError(f"the checkpoint's args lack {missing[0]!r}; pass the model with --config MODEL.yaml")
    fields: dict[str, Any] = {n: args[n] for n in _COPIED if args.get(n) is not None}
    position = _arg(args, "position_embedding_type", "learned_absolute")
    if position not in ("rope", "none"):
        raise MegatronError(f"args.position_embedding_type = {position!r}: only rope and none convert")
    heads = args["num_attention_heads"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    kv = args.get("kv_channels")
    fields.update(
        position_embedding_type=position, num_query_groups=groups if groups not in (None, heads) else None,
        kv_channels=kv if kv not in (None, args["hidden_size"] // heads) else None,
        vocab_size=vocab_size, make_vocab_size_divisible_by=1, rope_scaling=bool(args.get("use_rope_scaling")),
        norm_epsilon=float(_arg(args, "layernorm_epsilon", _arg(args, "norm_epsilon", 1e-5))),
        activation="swiglu" if args.get("swiglu") else "squared_relu" if args.get("squared_relu") else "gelu",
        tie_word_embeddings=not args.get("untie_embeddings_and_output_weights", False),
        num_moe_experts=None, mtp_num_layers=0)
    if args.get("num_experts"):
        fields.update(_moe_fields(args))
    if fields.get("normalization") not in (None, "RMSNorm", "LayerNorm"):
        raise MegatronError(f"args.normalization = {fields['normalization']!r}: only RMSNorm and LayerNorm convert")
    if fields.get("add_bias_linear"):
        fields["add_qkv_bias"] = True  # Megatron's linear_qkv has a bias whenever the linears do
    cfg = ModelConfig(**fields)
    cfg.validate()
    return cfg


def _moe_fields(args: dict[str, Any]) -> dict[str, Any]:
    freq = args.get("moe_layer_freq") or 1
    if not (type(freq) is int and freq >= 1) and not (isinstance(freq, list) and all(f in (0, 1) for f in freq)
                                                       and len(freq) == args["num_layers"]):
        raise MegatronError(f"args.moe_layer_freq = {freq!r}: give an integer >= 1 or a 0/1 list with one entry per "
                            "layer")
    fields = {n: args[n] for n in _MOE_COPIED if args.get(n) is not None}
    balancing = args.get("moe_router_load_balancing_type") or "aux_loss"
    balancing = balancing[0] if isinstance(balancing, list) and len(set(balancing)) == 1 else balancing
    if balancing not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
        raise MegatronError(f"args.moe_router_load_balancing_type = {balancing!r}: meshtron has aux_loss, "
                            "seq_aux_loss and none")
    router_dtype = args.get("moe_router_dtype")
    if router_dtype not in (None, "fp32"):
        raise MegatronError(f"args.moe_router_dtype = {router_dtype!r}: meshtron routes in fp32 or the input dtype")
    fields.update(num_moe_experts=args["num_experts"], moe_layer_freq=list(freq) if isinstance(freq, list) else freq,
                  moe_router_load_balancing_type="aux_loss" if balancing == "global_aux_loss" else balancing,
                  moe_router_dtype="input" if router_dtype is None else "fp32")
    return fields


def args_from_model_config(cfg: ModelConfig) -> dict[str, Any]:
    """Megatron-LM argument values for a ModelConfig the converter supports (check_supported first)."""
    args: dict[str, Any] = {n: getattr(cfg, n) for n in _COPIED}
    args.update(
        num_layers=cfg.pattern.count("*"), ffn_hidden_size=cfg.ffn_size, kv_channels=cfg.head_dim,
        group_query_attention=cfg.num_kv_heads != cfg.num_attention_heads, num_query_groups=cfg.num_kv_heads,
        padded_vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=1, vocab_size=cfg.vocab_size,
        position_embedding_type=cfg.position_embedding_type, use_rope_scaling=cfg.rope_scaling,
        layernorm_epsilon=cfg.norm_epsilon, norm_epsilon=cfg.norm_epsilon,
        swiglu=cfg.activation == "swiglu", squared_relu=cfg.activation == "squared_relu",
        untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, num_experts=None,
        ckpt_format="torch_dist", transformer_impl="local")
    if cfg.num_moe_experts and "E" in cfg.pattern:
        args.update({n: getattr(cfg, n) for n in _MOE_COPIED})
        moe_layers = [1 if s == "E" else 0 for s in cfg.pattern[1::2]]
        args.update(num_experts=cfg.num_moe_experts, moe_ffn_hidden_size=cfg.moe_ffn_size,
                    moe_layer_freq=1 if all(moe_layers) else moe_layers,
                    moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
                    moe_router_dtype=None if cfg.moe_router_dtype == "input" else "fp32")
    return args


def check_supported(cfg: ModelConfig) -> None:
    """The meshtron models this converter writes as Megatron GPTModel checkpoints; else one line naming the field."""

    def need(ok: bool, field: str, value: Any, why: str) -> None:
        if not ok:
            raise MegatronError(f"model.{field} = {value!r}: a Megatron GPTModel checkpoint needs {why}")

    need(re.fullmatch(r"(\*[-E])+", cfg.pattern) is not None, "layer_pattern", cfg.pattern, "attention then a dense "
         "MLP or MoE in every layer ('*-' and '*E' pairs); Mamba and other hybrid patterns do not convert")
    need(cfg.moe_router_type == "topk", "moe_router_type", cfg.moe_router_type, "the top-k router")
    need(not cfg.moe_router_add_bias, "moe_router_add_bias", True, "a router without a linear bias")
    need(not cfg.multi_latent_attention, "multi_latent_attention", True, "grouped-query attention")
    need(cfg.position_embedding_type in ("rope", "none"), "position_embedding_type", cfg.position_embedding_type,
         "rope or none")
    need(cfg.activation in ("swiglu", "gelu", "squared_relu"), "activation", cfg.activation,
         "swiglu, gelu or squared_relu")
    need(cfg.window_size is None, "window_size", cfg.window_size, "full attention")
    need(cfg.softmax_type == "vanilla", "softmax_type", cfg.softmax_type, "the vanilla softmax")
    need(cfg.softmax_scale in (None, cfg.head_dim ** -0.5), "softmax_scale", cfg.softmax_scale, "1/sqrt(head_dim)")
    need(cfg.activation_func_clamp_value is None and cfg.glu_linear_offset == 0.0, "activation_func_clamp_value",
         cfg.activation_func_clamp_value, "no MLP clamp or linear offset")
    need(cfg.add_qkv_bias or not cfg.add_bias_linear, "add_qkv_bias", cfg.add_qkv_bias,
         "q/k/v biases whenever add_bias_linear is set (linear_qkv has one bias)")
    need(cfg.attention_output_bias == cfg.add_bias_linear, "add_bias_attention_output", cfg.add_bias_attention_output,
         "the attention-output bias to follow add_bias_linear (one switch in Megatron): null")
    need(not cfg.rope_scaling or cfg.rope_scaling_type == "llama3", "rope_scaling_type", cfg.rope_scaling_type,
         "llama3 (use_rope_scaling); linear frequency scaling has no Megatron argument")


# ---- tensors -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """One Megatron tensor and the meshtron parameters it holds (rows concatenated in order, or the
    query-group layout for `qkv`). Layer pieces name both sides relative to the layer / sublayer."""

    megatron: str
    parts: tuple[str, ...]
    sublayer: int = 0             # 0: the attention sublayer of the layer, 1: its MLP or MoE (layer pieces)
    qkv: bool = False
    dim: int = 0                  # the dimension the parts are concatenated along (1 for stacked experts)
    local_name: Optional[str] = None  # the local spec's own name (read, never written)


LAYER_PIECES = (
    Piece("self_attention.linear_qkv.layer_norm_weight", ("norm.weight",), local_name="input_layernorm.weight"),
    Piece("self_attention.linear_qkv.layer_norm_bias", ("norm.bias",), local_name="input_layernorm.bias"),
    Piece("self_attention.linear_qkv.weight", ("mixer.wq.weight", "mixer.wk.weight", "mixer.wv.weight"), qkv=True),
    Piece("self_attention.linear_qkv.bias", ("mixer.wq.bias", "mixer.wk.bias", "mixer.wv.bias"), qkv=True),
    Piece("self_attention.q_layernorm.weight", ("mixer.q_norm.weight",)),
    Piece("self_attention.q_layernorm.bias", ("mixer.q_norm.bias",)),
    Piece("self_attention.k_layernorm.weight", ("mixer.k_norm.weight",)),
    Piece("self_attention.k_layernorm.bias", ("mixer.k_norm.bias",)),
    Piece("self_attention.linear_proj.weight", ("mixer.wo.weight",)),
    Piece("self_attention.linear_proj.bias", ("mixer.wo.bias",)),
    Piece("mlp.linear_fc1.layer_norm_weight", ("norm.weight",), 1, local_name="pre_mlp_layernorm.weight"),
    Piece("mlp.linear_fc1.layer_norm_bias", ("norm.bias",), 1, local_name="pre_mlp_layernorm.bias"),
    Piece("mlp.linear_fc1.weight", ("mixer.w_gate.weight", "mixer.w_up.weight"), 1),
    Piece("mlp.linear_fc1.bias", ("mixer.w_gate.bias", "mixer.w_up.bias"), 1),
    Piece("mlp.linear_fc2.weight", ("mixer.w_down.weight",), 1),
    Piece("mlp.linear_fc2.bias", ("mixer.w_down.bias",), 1),
    # MoE: the router, the experts stacked on an expert axis (SequentialMLP and grouped experts save
    # `experts.experts.*` with shape (experts, ...)), the shared experts and their gate
    Piece("mlp.router.weight", ("mixer.router.weight",), 1),
    Piece("mlp.router.expert_bias", ("mixer.router.expert_bias",), 1),
    Piece("mlp.experts.experts.linear_fc1.weight", ("mixer.experts.w_gate", "mixer.experts.w_up"), 1, dim=1),
    Piece("mlp.experts.experts.linear_fc2.weight", ("mixer.experts.w_down",), 1),
    Piece("mlp.shared_experts.linear_fc1.weight", ("mixer.shared_experts.w_gate.weight",
                                                   "mixer.shared_experts.w_up.weight"), 1),
    Piece("mlp.shared_experts.linear_fc2.weight", ("mixer.shared_experts.w_down.weight",), 1),
    Piece("mlp.shared_experts.gate_weight", ("mixer.shared_expert_gate.weight",), 1),
)
GLOBAL_PIECES = (
    Piece("embedding.word_embeddings.weight", ("embedding.weight",)),
    Piece("decoder.final_layernorm.weight", ("final_norm.weight",)),
    Piece("decoder.final_layernorm.bias", ("final_norm.bias",)),
    Piece("output_layer.weight", ("output.weight",)),
)
# The linears whose (empty, for the local spec) `_extra_state` Megatron saves per layer: attention,
# then a dense MLP's, or an MoE layer's shared experts' (per layer) and experts' (per layer and expert).
ATTENTION_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv")
DENSE_EXTRA_STATE = ("mlp.linear_fc1", "mlp.linear_fc2")
SHARED_EXPERT_EXTRA_STATE = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_EXTRA_STATE = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
LAYERS_PREFIX = "decoder.layers."


@dataclass(frozen=True)
class LayerMap:
    """A piece placed in the model: its meshtron parameter names, or per layer with `layer` set."""

    piece: Piece
    parts: tuple[str, ...]        # full meshtron names (of layer `layer` for a layer piece)
    layer: Optional[int] = None


def piece_maps(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> list[LayerMap]:
    """Every piece the model has (a piece is kept when its meshtron parameters exist), layer by layer."""
    maps = []
    for piece in GLOBAL_PIECES:
        if all(p in shapes for p in piece.parts):
            maps.append(LayerMap(piece, piece.parts))
    for layer in range(cfg.pattern.count("*")):
        for piece in LAYER_PIECES:
            prefix = f"layers.{2 * layer + piece.sublayer}."
            parts = tuple(prefix + p for p in piece.parts if prefix + p in shapes)
            if parts:
                maps.append(LayerMap(piece, parts, layer))
    return maps


def split_qkv(fused: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    """linear_qkv (weight or bias) -> [wq, wk, wv], undoing the per-query-group interleave."""
    groups, head_dim = cfg.num_kv_heads, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    grouped = fused.reshape(groups, per_group + 2, head_dim, *fused.shape[1:])
    q = grouped[:, :per_group].reshape(groups * per_group * head_dim, *fused.shape[1:])
    return [q, grouped[:, per_group].reshape(groups * head_dim, *fused.shape[1:]),
            grouped[:, per_group + 1].reshape(groups * head_dim, *fused.shape[1:])]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    groups, head_dim = cfg.num_kv_heads, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(groups, per_group, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                         v.reshape(groups, 1, head_dim, *rest)], dim=1)
    return grouped.reshape(groups * (per_group + 2) * head_dim, *rest)


def to_meshtron(m: LayerMap, tensor: torch.Tensor, cfg: ModelConfig,
                shapes: dict[str, tuple[int, ...]]) -> list[torch.Tensor]:
    """The meshtron parameters held by one Megatron tensor (of one layer)."""
    if m.piece.qkv:
        return split_qkv(tensor, cfg)
    if len(m.parts) == 1:
        return [tensor]
    d = m.piece.dim
    return list(tensor.split([shapes[p][d] for p in m.parts], dim=d))


def to_megatron(m: LayerMap, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    if m.piece.qkv:
        return fuse_qkv(*parts, cfg)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=m.piece.dim)


def megatron_shape(m: LayerMap, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The Megatron tensor's shape for one layer (without the stacking axis)."""
    shape = list(shapes[m.parts[0]])
    shape[m.piece.dim] = sum(shapes[p][m.piece.dim] for p in m.parts)
    return tuple(shape)


def config_table() -> str:
    """The Markdown table of docs/megatron.md: every ModelConfig field and its Megatron argument."""
    rows = ["| meshtron `model.` field | Megatron argument (`args.` attribute) | note |", "|---|---|---|"]
    for f in dataclasses.fields(ModelConfig):
        if f.name in ARGUMENTS:
            arg, note = ARGUMENTS[f.name]
            rows.append(f"| `{f.name}` | `{arg}` | {note} |")
        else:
            rows.append(f"| `{f.name}` | — | none: megatron-to-meshtron leaves the default, meshtron-to-megatron does not write it |")
    return "\n".join(rows) + "\n"
