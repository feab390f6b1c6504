"""EngineConfig: every option of the serving engine, typed and checked once.

The CLI (`meshtron serve` / `generate`) builds its flags from these fields, so each field's help
string is the documentation of the flag. Sizes the engine can derive (the number of KV blocks,
the context length) default to None and are resolved against the model in `resolve()`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import InitVar, dataclass
from typing import Optional

from meshtron.config.fields import ConfigError, option
from meshtron.config.flags import BoolFlag


@dataclass(kw_only=True)
class EngineConfig:
    block_size: int = option(16, "Tokens per KV-cache block (the unit of allocation and prefix sharing)")
    num_blocks: Optional[int] = option(None, "KV-cache blocks; null sizes the cache from kv_cache_memory_mb")
    kv_cache_memory_mb: Optional[float] = option(None, "Memory for keys/values when num_blocks is null, in MiB; "
                                                       "null: on CUDA what gpu_memory_utilization leaves after a "
                                                       "profiled max-size step, on a CPU 512")
    gpu_memory_utilization: float = option(0.9, "CUDA: share of the GPU's memory the engine may use (weights, "
                                                "activations and the KV cache) when kv_cache_memory_mb is null")
    max_num_seqs: int = option(64, "Most requests running at once (the batch's request dimension)")
    max_num_batched_tokens: int = option(512, "Token budget of one step, prefill chunks and decodes together")
    enable_chunked_prefill: bool = option(True, "Split long prompts over steps so decodes keep flowing")
    enable_prefix_caching: bool = option(True, "Reuse cached blocks of identical prompt prefixes (by content hash)")
    max_model_len: Optional[int] = option(None, "Longest prompt + output; null means model.max_position_embeddings")
    seed: int = option(0, "Seed for requests that give none (each request gets its own generator)")
    device: str = option("auto", "Where to run: auto, cpu, cuda")
    dtype: str = option("auto", "Dtype of the served weights and so of the KV cache: auto (bfloat16 on CUDA, "
                                "float32 on a CPU), float32, bfloat16 or float16")
    cuda_graphs: bool = option(False, "CUDA only: replay captured graphs for steps a bucket holds (eager otherwise)")
    cuda_graph_batch_sizes: tuple[int, ...] = option((1, 2, 4, 8, 16, 32, 64),
                                                     "CUDA graphs: buckets of the decode request count")
    cuda_graph_token_sizes: tuple[int, ...] = option((64, 128, 256, 512),
                                                     "CUDA graphs: buckets of the token count of steps with prefills")
    cuda_graph_prefill_sizes: tuple[int, ...] = option((1, 2, 4), "CUDA graphs: a step with more prefill chunks "
                                                                  "than the largest of these runs eagerly")
    cuda_graph_key_sizes: tuple[int, ...] = option((256, 1024, 4096, 16384, 65536),
                                                   "CUDA graphs: buckets of the keys (tokens) a row reads; sizes "
                                                   "below max_model_len, plus max_model_len")
    decode_attention: str = option("auto", "Attention of the varlen layout: auto (the fastest available: "
                                           "native on a CPU when the C kernel builds and the weights are float32, "
                                           "else gather; flex on CUDA), gather (gather the blocks + SDPA), "
                                           "compiled (one torch.compile kernel; ~15 s to compile on a CPU), "
                                           "native (the C kernel: CPU, float32, built on first use with the "
                                           "system C compiler and cached) or flex (decodes and prefill chunks in "
                                           "one FlexAttention call per layer reading the cache through the block "
                                           "tables; compiled on CUDA, an eager reference on a CPU: tests only)")
    layout: str = option("varlen", "Batch layout: varlen (one packed row; attention per decode bucket and per "
                                   "prefill chunk), auto (cheapest by estimate: packed or rows of S tokens), "
                                   "packed (one row, one attention) or padded (one row per request)")
    pp_micro_batches: int = option(0, "Pipeline-parallel serving (serve --pp): micro-batches each step's batch is "
                                      "cut into, run through the stages one after another (pp steps are in "
                                      "flight at once either way); 0 means 1")
    quantize: str = option("none", "Quantize the linear layers' weights after loading, through torchao (pip install "
                                   "meshtron[quant]): none, int8-weight-only, int4-weight-only (groups of 128; a "
                                   "CPU, or CUDA with dtype bfloat16), float8-weight-only or float8-dynamic (CUDA "
                                   "compute capability >= 8.9); activations and the KV cache keep the dtype")
    tokenizer: Optional[str] = option(None, "Tokenizer directory or file to use instead of the one saved with the "
                                            "checkpoint (same tokenizer type); default: the checkpoint's own")
    speculative_method: str = option("none", "Speculative decoding: none, mtp (draft with the model's own MTP depth 1, "
                                             "model.mtp_num_layers >= 1) or draft (a separate small model, "
                                             "speculative_model); the output distribution stays the model's own")
    num_speculative_tokens: int = option(2, "Speculative decoding: tokens drafted per request and step, verified "
                                            "in one forward of the model")
    speculative_model: Optional[str] = option(None, "Speculative decoding with speculative_method draft: the draft "
                                                    "model's checkpoint (same tokenizer and vocabulary)")

    # replaced by decode_attention: set only to say so (init-only, no flag, not a field)
    compile_decode_attention: InitVar[Optional[bool]] = None
    native_decode_attention: InitVar[Optional[bool]] = None

    LAYOUTS = ("varlen", "auto", "packed", "padded")
    DTYPES = ("auto", "float32", "bfloat16", "float16")
    DECODE_ATTENTIONS = ("auto", "gather", "compiled", "native", "flex")
    QUANTIZE_MODES = ("none", "int8-weight-only", "int4-weight-only", "float8-weight-only", "float8-dynamic")

    def __post_init__(self, compile_decode_attention: Optional[bool], native_decode_attention: Optional[bool]) -> None:
        for name, value in (("compile_decode_attention", compile_decode_attention),
                            ("native_decode_attention", native_decode_attention)):
            if value is not None:
                raise ConfigError(f"engine.{name} was replaced by engine.decode_attention: set decode_attention="
                                  f"{REPLACED[name]!r} (auto, the default, picks native on a CPU)")

    def validate(self) -> None:
        def need(ok: bool, name: str, value, rule: str) -> None:
            if not ok:
                raise ConfigError(f"engine.{name}: {value!r} is not allowed; {rule}")

        need(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        need(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", self.num_blocks, "must be >= 1 or null")
        need(self.kv_cache_memory_mb is None or self.kv_cache_memory_mb > 0, "kv_cache_memory_mb",
             self.kv_cache_memory_mb, "must be > 0 or null")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization,
             "must be in (0, 1]")
        need(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        need(self.pp_micro_batches >= 0, "pp_micro_batches", self.pp_micro_batches, "must be >= 0 (0: 1)")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 1")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be >= 2")
        need(self.device in ("auto", "cpu", "cuda"), "device", self.device, "choose auto, cpu or cuda")
        need(self.dtype in self.DTYPES, "dtype", self.dtype, f"choose one of {self.DTYPES}")
        need(self.layout in self.LAYOUTS, "layout", self.layout, f"choose one of {self.LAYOUTS}")
        need(self.decode_attention in self.DECODE_ATTENTIONS, "decode_attention", self.decode_attention,
             f"choose one of {self.DECODE_ATTENTIONS}")
        need(self.decode_attention in ("auto", "gather") or self.layout == "varlen", "decode_attention",
             self.decode_attention, f"it applies to the varlen layout only (layout is {self.layout!r}); set layout "
             "varlen, or decode_attention auto")
        need(self.quantize in self.QUANTIZE_MODES, "quantize", self.quantize,
             f"choose one of {', '.join(self.QUANTIZE_MODES)}")
        self._validate_speculative(need)
        for name in GRAPH_BUCKET_FIELDS:
            need(all(b >= 1 for b in getattr(self, name)), name, getattr(self, name), "every bucket must be >= 1")

    def _validate_speculative(self, need) -> None:
        method = self.speculative_method
        need(method in ("none", "mtp", "draft"), "speculative_method", method, "choose none, mtp or draft")
        if method == "none":
            return
        need(self.num_speculative_tokens >= 1, "num_speculative_tokens", self.num_speculative_tokens, "must be >= 1")
        need(self.max_num_batched_tokens > self.num_speculative_tokens, "max_num_batched_tokens",
             self.max_num_batched_tokens, f"must exceed num_speculative_tokens ({self.num_speculative_tokens}): a "
             "token and its drafts are verified in one step")
        need(method == "draft" or self.speculative_model is None, "speculative_model", self.speculative_model,
             "it applies to speculative_method draft only")
        need(not self.cuda_graphs, "cuda_graphs", True, "speculative decoding runs eagerly; set cuda_graphs false")

    def resolve(self, model_max_len: int, bytes_per_token: int, recurrent_state: bool = False) -> EngineConfig:
        """A copy with max_model_len and num_blocks filled in and cross-field rules checked.

        bytes_per_token: key/value bytes per token (0 without attention: blocks then only count
        tokens, enough for max_num_seqs full-length requests). recurrent_state: the model has Mamba
        layers, whose per-request state is scanned one chunk at a time and is not kept per block, so
        prefix caching is off and only the varlen layout applies.
        """
        self.validate()
        max_len = self.max_model_len or model_max_len
        if max_len > model_max_len:
            raise ConfigError(f"engine.max_model_len: {max_len} exceeds the model's max_position_embeddings "
                              f"{model_max_len}; lower it")
        num_blocks = self.num_blocks
        if num_blocks is None and bytes_per_token == 0:
            num_blocks = self.max_num_seqs * -(-max_len // self.block_size)
        elif num_blocks is None:
            memory_mb = CPU_KV_CACHE_MB if self.kv_cache_memory_mb is None else self.kv_cache_memory_mb
            num_blocks = max(1, int(memory_mb * 2**20) // max(1, bytes_per_token * self.block_size))
        out = dataclasses.replace(self, max_model_len=max_len, num_blocks=num_blocks)
        if recurrent_state:
            if out.layout != "varlen" or out.cuda_graphs:
                name, value = ("layout", out.layout) if out.layout != "varlen" else ("cuda_graphs", True)
                raise ConfigError(f"engine.{name}: {value!r} is not allowed for a model with Mamba layers (each "
                                  "request's chunk is scanned in one piece); use layout varlen without cuda_graphs")
            out = dataclasses.replace(out, enable_prefix_caching=False)
            if out.speculative_method != "none":
                raise ConfigError(f"engine.speculative_method: {out.speculative_method!r} is not allowed for a model "
                                  "with Mamba layers (their state cannot be rolled back past rejected drafts); "
                                  "use speculative_method none")
        if not out.enable_chunked_prefill and out.max_num_batched_tokens < max_len:
            raise ConfigError(f"engine.max_num_batched_tokens: {out.max_num_batched_tokens} is below max_model_len "
                              f"{max_len}, so without chunked prefill a long prompt could never run; raise it "
                              "or enable chunked prefill")
        return out

    @property
    def max_cached_tokens(self) -> int:
        assert self.num_blocks is not None, "resolve() the config first"
        return self.num_blocks * self.block_size


# the KV cache when kv_cache_memory_mb is null and no profile sized it (a CPU): a fixed size, since a
# CPU machine's memory is shared with everything else (CI: 24 GB for all tests)
CPU_KV_CACHE_MB = 512.0
GRAPH_BUCKET_FIELDS = ("cuda_graph_batch_sizes", "cuda_graph_token_sizes", "cuda_graph_prefill_sizes",
                       "cuda_graph_key_sizes")
# the booleans decode_attention replaced, and the choice each one meant
REPLACED = {"compile_decode_attention": "compiled", "native_decode_attention": "native"}


def engine_config_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(EngineConfig))


def add_engine_arguments(parser, skip: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field (--max-num-seqs ...), help and default from the field."""
    for f in engine_config_fields():
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"] + f" (default {f.default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=f.name, action=BoolFlag, default=f.default,
                                help=help_text)
        elif f.name in GRAPH_BUCKET_FIELDS:
            parser.add_argument(flag, dest=f.name, default=f.default, help=help_text + "; comma-separated",
                                type=lambda s: tuple(int(x) for x in s.split(",") if x))
        else:
            kind = {"int": int, "Optional[int]": int, "float": float, "Optional[float]": float, "str": str,
                    "Optional[str]": str}[str(f.type)]
            parser.add_argument(flag, dest=f.name, type=kind, default=f.default, help=help_text)
    for name, choice in REPLACED.items():  # the old flags say what replaced them (hidden from --help)
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, "--no-" + flag[2:], nargs=0, action=_Replaced, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS, dest="replaced_" + name, const=choice)


class _Replaced(argparse.Action):
    """A removed flag: one line naming the flag that replaced it."""

    def __call__(self, parser, namespace, values, option_string=None):
        choice = "gather" if option_string.startswith("--no-") else self.const
        parser.error(f"{option_string} was replaced by --decode-attention {choice} (auto, the default, picks "
                     "native on a CPU)")


def engine_config_from_args(args, skip: tuple[str, ...] = ()) -> EngineConfig:
    cfg = EngineConfig(**{f.name: getattr(args, f.name) for f in engine_config_fields()
                          if f.name not in skip and hasattr(args, f.name)})
    cfg.validate()
    return cfg
