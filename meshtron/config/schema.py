"""The typed configuration of a run: one dataclass per component under `RunConfig`.

Every knob is declared here exactly once (type, default, help); the model section lives in
`config/model.py` and is re-exported here. Cross-field checks live in each class's `validate()` and
raise `ConfigError` naming the field and what is allowed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Literal, Optional

from meshtron.config.fields import ConfigError, check, option
from meshtron.config.model import LAYER_SYMBOLS, ModelConfig  # noqa: F401 (LAYER_SYMBOLS: public here before the split)


@dataclass(kw_only=True)
class ParallelConfig:
    """How the run is split over processes (one DeviceMesh), recompute and compile."""

    dp_replicate: int = option(1, "Data-parallel replicas (HSDP outer axis; gradients all-reduced across them)")
    dp_shard: int = option(-1, "FSDP shard degree; -1 takes what the other axes leave of the world size")
    cp: int = option(1, "Context-parallel degree (the sequence is split over these ranks)")
    tp: int = option(1, "Tensor-parallel degree")
    pp: int = option(1, "Pipeline-parallel degree")
    ep: int = option(1, "Expert-parallel degree: routed experts split over this many of the dp_shard x cp ranks")
    ep_dispatcher: Literal["alltoall", "allgather"] = option(
        "alltoall", "With ep > 1: how tokens reach their experts' ranks (uneven all-to-all, or all-gather + reduce-scatter)")
    expert_tensor_parallel: bool = option(
        False, "With tp > 1: split each routed expert's ffn width over tp too (else routed experts replicate over tp)")
    sequence_parallel: bool = option(True, "With tp > 1: split norms/dropout/residual activations along the sequence")
    loss_parallel: bool = option(True, "With tp > 1: keep logits vocabulary-sharded through the cross-entropy")
    fsdp_reshard_after_forward: bool = option(True, "FSDP: free gathered parameters after forward (ZeRO-3); false keeps them (ZeRO-2)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = option(
        "1f1b", "Pipeline schedule (interleaved and zero_bubble use virtual stages)")
    pp_virtual_stages: int = option(1, "Model chunks per pipeline rank (interleaved schedules need >= 2)")
    pp_first_stage_sublayers: Optional[int] = option(None, "Sublayers on the first stage; null splits the pattern evenly")
    pp_last_stage_sublayers: Optional[int] = option(None, "Sublayers on the last stage; null splits the pattern evenly")
    cp_load_balance: bool = option(True, "CP: zig-zag sequence sharding so every rank gets equal causal work")
    activation_checkpoint: Literal["none", "full", "selective"] = option(
        "none", "Recompute activations in backward: every sublayer (full) or attention and Mamba sublayers only (selective)")
    compile: bool = option(False, "torch.compile each sublayer")
    timeout_s: float = option(600.0, "Timeout of every collective and process group, in seconds")
    straggler_interval: int = option(0, "Every N steps log the slowest and fastest ranks by step time (CPU time of the "
                                      "training thread on CPU, wall time on CUDA; 0: off)")

    def validate(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep", "pp_virtual_stages"):
            check(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name), "must be >= 1")
        check(self.dp_shard == -1 or self.dp_shard >= 1, "parallel.dp_shard", self.dp_shard, "must be -1 or >= 1")
        check(self.timeout_s > 0, "parallel.timeout_s", self.timeout_s, "must be > 0")
        check(self.straggler_interval >= 0, "parallel.straggler_interval", self.straggler_interval, "must be >= 0")
        if self.pp_schedule == "interleaved_1f1b":
            check(self.pp_virtual_stages >= 2, "parallel.pp_virtual_stages", self.pp_virtual_stages,
                  "interleaved_1f1b needs >= 2 virtual stages per rank")
        for name in ("pp_first_stage_sublayers", "pp_last_stage_sublayers"):
            v = getattr(self, name)
            check(v is None or v >= 1, f"parallel.{name}", v, "must be >= 1 or null")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer and gradient clipping."""

    type: Literal["adam", "sgd"] = option("adam", "Optimizer")
    lr: float = option(1e-3, "Peak learning rate")
    weight_decay: float = option(0.1, "Weight decay (never applied to norms and biases)")
    decoupled_weight_decay: bool = option(True, "Adam only: decoupled weight decay (AdamW) instead of L2 in the gradient")
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.95, "Adam beta2")
    adam_eps: float = option(1e-8, "Adam epsilon")
    sgd_momentum: float = option(0.0, "SGD momentum")
    clip_grad: float = option(1.0, "Clip the global gradient norm to this; 0 disables clipping")
    offload_fraction: float = option(0.0, "Fraction of optimizer states (by parameter count) kept in host memory "
                                          "(pinned on CUDA) and stepped on the CPU; 0 keeps all on the device")
    offload_overlap: bool = option(True, "With offload on CUDA: copy gradients and parameters on a side stream, "
                                         "pipelined with the CPU step chunk by chunk")

    def validate(self) -> None:
        check(self.lr > 0, "optimizer.lr", self.lr, "must be > 0")
        check(0.0 <= self.offload_fraction <= 1.0, "optimizer.offload_fraction", self.offload_fraction,
              "must be in [0, 1]")
        check(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "must be >= 0")
        check(0 <= self.adam_beta1 < 1, "optimizer.adam_beta1", self.adam_beta1, "must be in [0, 1)")
        check(0 <= self.adam_beta2 < 1, "optimizer.adam_beta2", self.adam_beta2, "must be in [0, 1)")
        check(self.adam_eps > 0, "optimizer.adam_eps", self.adam_eps, "must be > 0")
        check(self.clip_grad >= 0, "optimizer.clip_grad", self.clip_grad, "must be >= 0 (0 disables)")
        check(0 <= self.sgd_momentum < 1, "optimizer.sgd_momentum", self.sgd_momentum, "must be in [0, 1)")


@dataclass(kw_only=True)
class SchedulerConfig:
    """Learning-rate warmup and decay."""

    warmup_steps: int = option(100, "Linear warmup steps from warmup_init_lr to optimizer.lr")
    warmup_init_lr: float = option(0.0, "Learning rate at step 0")
    decay_style: Literal["cosine", "linear", "constant", "WSD"] = option("cosine", "Decay after warmup")
    decay_steps: Optional[int] = option(None, "Step at which decay reaches min_lr; null means train.train_iters")
    min_lr: float = option(1e-4, "Learning rate at the end of decay")
    wsd_decay_steps: Optional[int] = option(None, "WSD: length of the final decay phase; null means 10% of decay_steps")
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = option("linear", "WSD: shape of the final decay")

    def validate(self) -> None:
        check(self.warmup_steps >= 0, "scheduler.warmup_steps", self.warmup_steps, "must be >= 0")
        check(self.min_lr >= 0, "scheduler.min_lr", self.min_lr, "must be >= 0")
        check(self.warmup_init_lr >= 0, "scheduler.warmup_init_lr", self.warmup_init_lr, "must be >= 0")
        if self.decay_steps is not None:
            check(self.decay_steps >= 1, "scheduler.decay_steps", self.decay_steps, "must be >= 1 or null")
        if self.wsd_decay_steps is not None:
            check(self.wsd_decay_steps >= 1, "scheduler.wsd_decay_steps", self.wsd_decay_steps, "must be >= 1 or null")


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop: steps, batch sizes, precision, device, evaluation, run directory."""

    train_iters: int = option(1000, "Optimizer steps to run")
    micro_batch_size: int = option(8, "Sequences per forward/backward")
    global_batch_size: int = option(8, "Sequences per optimizer step (micro-batches are accumulated)")
    seed: int = option(1234, "Seed of parameter init, dropout and sampling")
    precision: Literal["auto", "fp32", "bf16"] = option(
        "auto", "Compute precision: auto (bf16 on CUDA, fp32 on a CPU), fp32 (TF32 matmuls on CUDA) or bf16 "
                "(autocast); weights, optimizer states and gradient reductions stay fp32")
    device: Literal["auto", "cpu", "cuda"] = option("auto", "Where to train; auto picks cuda when available")
    num_threads: Optional[int] = option(None, "torch intra-op threads; null leaves PyTorch's default")
    eval_interval: int = option(100, "Evaluate every N steps (0 disables)")
    eval_iters: int = option(10, "Validation micro-batches per evaluation")
    max_nonfinite_steps: int = option(5, "Stop after this many consecutive steps with non-finite loss or grad norm")
    peak_flops: Optional[float] = option(None, "Peak FLOP/s for MFU; null measures a matmul at start-up")
    run_dir: str = option("runs/default", "Directory for the resolved config, metrics and checkpoints")
    debug_nonfinite_steps: list[int] = option([], "Testing aid: force a non-finite loss at these steps")
    init_from_hf: Optional[str] = option(None, "Start from a Hugging Face model directory (config.json + safetensors): "
                                               "architecture and weights come from it, dropout/init/MTP from model.*")
    float8: bool = option(False, "Float8 matmuls in the linear layers (torchao convert_to_float8_training, tensorwise "
                                 "scales; the output head and dims not multiples of 16 stay) on a CUDA GPU of compute "
                                 "capability >= 8.9; refused elsewhere (pip install meshtron[quant])")

    def validate(self) -> None:
        check(self.train_iters >= 1, "train.train_iters", self.train_iters, "must be >= 1")
        check(self.micro_batch_size >= 1, "train.micro_batch_size", self.micro_batch_size, "must be >= 1")
        check(self.global_batch_size >= 1, "train.global_batch_size", self.global_batch_size, "must be >= 1")
        check(self.eval_interval >= 0, "train.eval_interval", self.eval_interval, "must be >= 0")
        check(self.eval_iters >= 1, "train.eval_iters", self.eval_iters, "must be >= 1")
        check(self.max_nonfinite_steps >= 1, "train.max_nonfinite_steps", self.max_nonfinite_steps, "must be >= 1")
        if self.num_threads is not None:
            check(self.num_threads >= 1, "train.num_threads", self.num_threads, "must be >= 1 or null")
        if self.peak_flops is not None:
            check(self.peak_flops > 0, "train.peak_flops", self.peak_flops, "must be > 0 or null")


@dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer turns text into ids, and its special tokens."""

    type: Literal["byte", "hf", "sentencepiece", "tiktoken"] = option(
        "byte", "Tokenizer kind: byte (no files), hf (a tokenizer.json directory), sentencepiece (.model), tiktoken (BPE file)")
    path: Optional[str] = option(None, "Tokenizer directory (hf) or file (sentencepiece, tiktoken); unused by byte")
    eod_token: Optional[str] = option(None, "End-of-document token; null reads the tokenizer's eos (or <|endoftext|>)")
    pad_token: Optional[str] = option(None, "Padding token; null reads the tokenizer's pad (or <|pad|>), else adds one id")
    bos_token: Optional[str] = option(None, "Beginning-of-sequence token; null reads the tokenizer's bos if it has one")
    allow_ambiguous_pad_tokens: bool = option(
        False, "Accept a pad id equal to the eod or bos id (padding then cannot be told apart from real tokens)")
    tiktoken_pattern: str = option("cl100k", "tiktoken: pre-split regex, or a preset name: gpt2, cl100k")
    tiktoken_special_tokens: list[str] = option(
        ["<|endoftext|>", "<|pad|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"],
        "tiktoken: special tokens after the BPE ranks, in order; 'TOKEN=ID' pins an id")

    def validate(self) -> None:
        check(self.type == "byte" or bool(self.path), "tokenizer.path", self.path,
              f"tokenizer.type {self.type} needs a path (a tokenizer.json directory, .model or .tiktoken file)")
        for entry in self.tiktoken_special_tokens:
            token, _, pinned = entry.rpartition("=") if "=" in entry else (entry, "", "")
            check(bool(token) and (not pinned or pinned.isdigit()), "tokenizer.tiktoken_special_tokens", entry,
                  "give TOKEN or TOKEN=ID with a non-negative integer id")


@dataclass(kw_only=True)
class DataConfig:
    """Datasets, their blend and split, sequence length, packing, fill-in-the-middle, chat (SFT) data."""

    format: Literal["indexed", "sft"] = option(
        "indexed", "indexed: data.paths are preprocessed prefixes (empty: the stdlib corpus); sft: data.paths are "
                   "chat jsonl files of {'messages': [{'role', 'content'}, ...]}, loss on assistant tokens only")
    paths: list[str] = option([], "Indexed dataset prefixes, optionally weighted: [0.7, prefA, 0.3, prefB]; "
                                  "empty uses the embedded corpus (CPython standard library sources)")
    split: str = option("969,30,1", "Train/valid/test weights over documents, e.g. '969,30,1'")
    seq_length: int = option(256, "Tokens per training sequence")
    seed: int = option(1234, "Seed of the document split and sample shuffle")
    reset_attention_mask: bool = option(False, "Attention never crosses document boundaries inside a sample")
    reset_position_ids: bool = option(False, "Positions restart at 0 at each document inside a sample")
    cache_dir: Optional[str] = option(None, "Where dataset indices are cached; null means '<prefix dir>/cache' next to the data")
    packing: Literal["concat", "best_fit"] = option(
        "concat", "concat: samples cut from the document stream; best_fit: whole documents packed per sample, padded")
    fim_rate: float = option(0.0, "Fill-in-the-middle: probability that a document (or fragment) is rearranged")
    fim_spm_rate: float = option(0.5, "FIM: probability of the SPM order instead of PSM for a rearranged document")
    fim_split_sample: Optional[str] = option(None, "FIM: token that splits a document into fragments rearranged one by one")
    fim_fragment_rate: float = option(0.5, "FIM: probability of rearranging each fragment when fim_split_sample is set")
    fim_no_prefix: Optional[str] = option(None, "FIM: documents starting with this string are never rearranged")
    fim_prefix_token: str = option("<|fim_prefix|>", "FIM sentinel before the prefix")
    fim_middle_token: str = option("<|fim_middle|>", "FIM sentinel before the middle")
    fim_suffix_token: str = option("<|fim_suffix|>", "FIM sentinel before the suffix")
    fim_pad_token: Optional[str] = option(None, "FIM padding token; null uses the tokenizer's pad token")
    sft_pack: bool = option(True, "SFT: pack whole conversations best-fit into each sample (false: one per sample, padded)")
    chat_template: Optional[str] = option(None, "SFT: a Jinja chat template file; null uses the tokenizer's own "
                                                "(tokenizer_config.json or chat_template.jinja), else ChatML")
    sample_order: Literal["megatron", "meshtron"] = option(
        "megatron", "megatron: the document/sample/shuffle indices megatron-core's GPTDataset builds (same seed, "
                    "split and seq_length give Megatron-LM's samples); meshtron: meshtron's earlier order")
    add_extra_token_to_sequence: bool = option(
        True, "Samples hold seq_length + 1 tokens so inputs and labels both have seq_length (Megatron's default); "
              "false: seq_length tokens, the last label masked")

    def split_weights(self) -> list[float]:
        try:
            parts = [float(p) for p in self.split.replace("/", ",").split(",")]
        except ValueError:
            raise ConfigError(f"data.split: {self.split!r} is not allowed; give three numbers like '969,30,1'") from None
        parts += [0.0] * (3 - len(parts))
        check(len(parts) == 3 and all(p >= 0 for p in parts) and parts[0] > 0, "data.split", self.split,
              "give up to three non-negative numbers with a positive train weight, like '969,30,1'")
        total = sum(parts)
        return [p / total for p in parts]

    def blend(self) -> tuple[list[float], list[str]]:
        """`paths` as (normalised weights, prefixes): [a, b] weighs by nothing (equal), [w1, a, w2, b] by w."""
        paths = list(self.paths)
        if not paths:
            return [], []
        if len(paths) == 1 or not _is_number(paths[0]):
            check(not any(_is_number(p) for p in paths), "data.paths", paths,
                  "either give prefixes only, or alternate weight and prefix: [0.7, prefA, 0.3, prefB]")
            return [1.0 / len(paths)] * len(paths), paths
        check(len(paths) % 2 == 0, "data.paths", paths, "alternate weight and prefix: [0.7, prefA, 0.3, prefB]")
        weights, prefixes = paths[0::2], paths[1::2]
        check(all(_is_number(w) for w in weights) and not any(_is_number(p) for p in prefixes), "data.paths", paths,
              "alternate weight and prefix: [0.7, prefA, 0.3, prefB]")
        values = [float(w) for w in weights]
        check(all(v >= 0 for v in values) and sum(values) > 0, "data.paths", paths,
              "weights must be non-negative with a positive sum")
        return [v / sum(values) for v in values], prefixes

    def validate(self) -> None:
        check(self.seq_length >= 1, "data.seq_length", self.seq_length, "must be >= 1")
        check(self.seed >= 0, "data.seed", self.seed, "must be >= 0")
        self.split_weights()
        if self.format == "sft":
            check(bool(self.paths) and not any(_is_number(p) for p in self.paths), "data.paths", self.paths,
                  "data.format sft reads chat jsonl files: list them, e.g. [chats.jsonl]")
        else:
            self.blend()
        for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
            v = getattr(self, name)
            check(0.0 <= v <= 1.0, f"data.{name}", v, "must be in [0, 1]")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# `checkpoint.load: auto`: resume from the save directory when it holds a checkpoint, else start fresh
AUTO_LOAD = "auto"


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming (torch.distributed.checkpoint)."""

    save: Optional[str] = option(None, "Directory for checkpoints; null means <run_dir>/checkpoints")
    save_interval: Optional[int] = option(None, "Save every N steps (0: only at the end); null: every train_iters/10 "
                                                "steps, at least 50 and at most 1000 apart")
    save_at_end: bool = option(True, "Save when training finishes")
    load: Optional[str] = option(None, "Resume from this checkpoint directory (a step dir or its parent with 'latest'); "
                                       "auto: from the save directory if it holds one, else start fresh (for restarts)")
    keep_last: int = option(3, "Keep only the newest N checkpoints (0 keeps all)")
    async_save: bool = option(False, "Write checkpoints in a background thread")

    def validate(self) -> None:
        check(self.save_interval is None or self.save_interval >= 0, "checkpoint.save_interval", self.save_interval,
              "must be >= 0 or null")
        check(self.keep_last >= 0, "checkpoint.keep_last", self.keep_last, "must be >= 0")
        if self.load == AUTO_LOAD:
            check(self.save_interval != 0 or self.save_at_end, "checkpoint.load", self.load,
                  "auto resumes from checkpoints this run saves, but save_interval is 0 and save_at_end false: "
                  "set checkpoint.save_interval")


@dataclass(kw_only=True)
class LoggerConfig:
    """Metrics logging: interval, progress bar, TensorBoard, Weights & Biases."""

    log_interval: int = option(10, "Log metrics every N steps")
    progress_bar: Literal["auto", "on", "off"] = option("auto", "Progress bar (auto: only on a terminal)")
    tensorboard: bool = option(False, "Write TensorBoard events to <run_dir>/tensorboard (extra 'track')")
    wandb: bool = option(False, "Log to Weights & Biases (extra 'track'); logger.wandb_mode says online or offline")
    wandb_project: str = option("meshtron", "W&B project name")

    wandb_mode: Optional[Literal["online", "offline"]] = option(
        None, "W&B mode; null: the WANDB_MODE environment variable if set, else offline (nothing uploaded unasked)")

    def validate(self) -> None:
        check(self.log_interval >= 1, "logger.log_interval", self.log_interval, "must be >= 1")
        for name, module in TRACKERS.items():
            if getattr(self, name):
                require_tracker(name, module)


# The optional tracking sinks and the module each one imports (from the 'track' extra).
TRACKERS = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}


def require_tracker(name: str, module: str):
    """Import and return the module behind `logger.<name>`, or a one-line ConfigError saying how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"logger.{name}: true needs {module} ({e.msg or 'not installed'}); "
                          f"pip install 'meshtron[track]' or set logger.{name} false") from None


@dataclass(kw_only=True)
class GradsConfig:
    """Gradient capture for comparing runs (--save-wgrads / --save-dgrads; meshtron grads compare)."""

    save_wgrads: Optional[str] = option(None, "Directory for the weight gradients of every linear, embedding, MoE expert and router layer "
                                              "(full tensors, written by rank 0; also --save-wgrads)")
    save_dgrads: Optional[str] = option(None, "Directory for the input and output activation gradients of those layers "
                                              "(full tensors in global batch order; also --save-dgrads)")
    interval: int = option(1, "Capture at every N-th optimizer step (also --save-grads-interval)")

    def validate(self) -> None:
        check(self.interval >= 1, "grads.interval", self.interval, "must be >= 1")


@dataclass(kw_only=True)
class ProfileConfig:
    """torch.profiler traces of chosen steps, and NVTX ranges on CUDA."""

    steps: Optional[str] = option(None, "'a:b' records optimizer steps a to b-1 (1-based) with torch.profiler; null: off")
    dir: Optional[str] = option(None, "Where traces are written; null means <run_dir>/profile")
    record_shapes: bool = option(False, "Record operator input shapes in the trace")
    profile_memory: bool = option(False, "Record tensor allocations in the trace")
    with_stack: bool = option(False, "Record Python stacks in the trace (large)")
    nvtx: bool = option(False, "On CUDA: NVTX ranges around forward, backward, optimizer and communication (for nsys)")

    def step_range(self) -> Optional[tuple[int, int]]:
        """(first, end) optimizer steps to record, end excluded; None when profiling is off."""
        if self.steps is None:
            return None
        first, sep, end = str(self.steps).partition(":")
        ok = sep == ":" and first.strip().isdigit() and end.strip().isdigit()
        check(ok and 1 <= int(first) < int(end), "profile.steps", self.steps,
              "give 'a:b' with 1 <= a < b, records steps a to b-1 (quote it in YAML: '2:4')")
        return int(first), int(end)

    def validate(self) -> None:
        self.step_range()


@dataclass(kw_only=True)
class TeacherConfig:
    """The frozen teacher of knowledge distillation (meshtron distill)."""

    load: Optional[str] = option(None, "Distillation teacher: a meshtron checkpoint (a step dir or its parent with "
                                       "'latest') or a Hugging Face model directory (config.json + safetensors)")
    config: Optional[str] = option(None, "YAML file whose model section describes the teacher (any width, depth, "
                                         "pattern); null reads the config saved with the checkpoint")

    def validate(self) -> None:
        check(self.config is None or self.load is not None, "teacher.load", self.load,
              "teacher.config describes the teacher but its weights are needed too: set teacher.load")


@dataclass(kw_only=True)
class DistillConfig:
    """Knowledge distillation: the losses, their weights, temperature, top-k and hidden-state layer pairs."""

    losses: list[str] = option(["kl"], "Distillation losses: kl (forward KL), reverse_kl, topk_kl, hidden_cosine, "
                                       "hidden_mse, or any registered name")
    weights: list[float] = option([], "Weight of each loss in distill.losses, in order; empty gives each 1.0")
    label_weight: float = option(0.0, "Weight of the student's own cross-entropy on the labels")
    temperature: float = option(1.0, "Softmax temperature of the logits losses (their value is scaled by T^2)")
    top_k: int = option(32, "topk_kl: the teacher's k most likely tokens, renormalised over those k")
    layer_pairs: list[str] = option(["-1:-1"], "hidden_*: 'student:teacher' sublayer indices (0-based, negative from "
                                               "the end) whose outputs are compared; widths may differ")

    def parsed_layer_pairs(self) -> list[tuple[int, int]]:
        pairs = []
        for entry in self.layer_pairs:
            s, sep, t = str(entry).partition(":")
            try:
                pairs.append((int(s), int(t)))
            except ValueError:
                check(False, "distill.layer_pairs", entry, "give 'student:teacher' sublayer indices like '3:7' or '-1:-1'")
            check(sep == ":", "distill.layer_pairs", entry,
                  "give 'student:teacher' sublayer indices like '3:7' (quote them in YAML)")
        return pairs

    def validate(self) -> None:
        check(bool(self.losses), "distill.losses", self.losses, "name at least one loss, e.g. [kl]")
        check(not self.weights or len(self.weights) == len(self.losses), "distill.weights", self.weights,
              f"give one weight per loss in distill.losses ({len(self.losses)}) or none")
        check(all(w >= 0 for w in self.weights), "distill.weights", self.weights, "weights must be >= 0")
        check(self.label_weight >= 0, "distill.label_weight", self.label_weight, "must be >= 0")
        check(self.temperature > 0, "distill.temperature", self.temperature, "must be > 0")
        check(self.top_k >= 1, "distill.top_k", self.top_k, "must be >= 1")
        self.parsed_layer_pairs()

    def loss_weights(self) -> dict[str, float]:
        return dict(zip(self.losses, self.weights or [1.0] * len(self.losses)))


@dataclass(kw_only=True)
class RLConfig:
    """Reinforcement learning (meshtron rl): GRPO batch, loss variant, rollout engine, warm-up, evaluation."""

    prompts_per_step: int = option(16, "GRPO: prompts per step (over all data-parallel ranks)")
    group_size: int = option(8, "GRPO: completions sampled per prompt (advantages are normalised within a group)")
    max_new_tokens: int = option(16, "Longest completion, in tokens")
    temperature: float = option(1.0, "Sampling temperature of rollouts (the trainer's log probs use the same)")
    updates_per_step: int = option(1, "Optimizer steps per rollout batch (it is split into this many mini-batches)")
    pack_length: int = option(512, "Tokens per packed training row; a prompt plus its completion must fit")
    aggregation: Literal["sequence_mean", "token_mean", "fixed_length"] = option(
        "sequence_mean", "Token losses -> loss: sequence_mean (GRPO), token_mean (DAPO), fixed_length (Dr.GRPO)")
    scale_advantages_by_std: bool = option(True, "Divide group-centred rewards by the group's std (false: Dr.GRPO)")
    clip_eps_low: float = option(0.2, "PPO clip: the ratio is kept >= 1 - clip_eps_low where the advantage is negative")
    clip_eps_high: float = option(0.2, "PPO clip: the ratio is kept <= 1 + clip_eps_high where the advantage is "
                                       "positive (DAPO's clip-higher uses 0.28)")
    kl_beta: float = option(0.0, "Weight of the k3 KL penalty to the frozen reference (the model as GRPO starts)")
    entropy_coef: float = option(0.0, "Weight of the entropy bonus")
    is_truncation: Optional[float] = option(2.0, "Truncated importance sampling: weight tokens by "
                                                 "min(p_trainer / p_rollout, C) with C this; null turns it off")
    reward_clip: Optional[float] = option(None, "Clip rewards to [-c, c] before advantages; null leaves them")
    backend: Literal["engine", "openai", "transformers"] = option(
        "engine", "Rollouts from: engine (in process, the trained weights), openai (an HTTP server: its own "
        "weights), transformers (a Hugging Face copy of the trained model, refreshed before each rollout)")
    openai_base_url: Optional[str] = option(None, "backend openai: the server's base URL, e.g. http://host:8000/v1")
    openai_model: str = option("", "backend openai: the model name sent with each request")
    router_replay: bool = option(True, "MoE models, engine backend: training routes each token through the "
                                       "experts the rollout engine chose")
    engine_max_num_seqs: int = option(256, "Rollout engine: most sequences decoded at once")
    engine_max_num_batched_tokens: int = option(2048, "Rollout engine: token budget of one step")
    engine_kv_cache_memory_mb: float = option(64.0, "Rollout engine: KV-cache memory, in MiB")
    engine_block_size: int = option(16, "Rollout engine: tokens per KV-cache block")
    warmup_steps: int = option(0, "Supervised warm-up steps on the environment's demonstrations before GRPO")
    warmup_batch_size: int = option(64, "Warm-up: demonstrations per step")
    warmup_lr: float = option(1e-3, "Warm-up: peak learning rate (its own Adam; linear warmup over 10 steps, "
                                          "then cosine decay to a tenth of it)")
    eval_interval: int = option(10, "Evaluate on held-out problems every N GRPO steps, and before and after (0: "
                                    "only before and after)")
    eval_problems: int = option(200, "Held-out problems per evaluation")
    eval_samples: int = option(4, "Samples per held-out problem for pass@k (0: greedy only)")
    eval_k: int = option(4, "k of pass@k (<= eval_samples)")
    eval_temperature: float = option(1.0, "Temperature of the pass@k samples")
    init_checkpoint: Optional[str] = option(None, "Start from the weights of this checkpoint (a step dir or its parent)")

    def validate(self) -> None:
        for name in ("prompts_per_step", "max_new_tokens", "updates_per_step", "pack_length", "engine_max_num_seqs",
                     "engine_max_num_batched_tokens", "engine_block_size", "warmup_batch_size", "eval_problems", "eval_k"):
            check(getattr(self, name) >= 1, f"rl.{name}", getattr(self, name), "must be >= 1")
        check(self.group_size >= 2, "rl.group_size", self.group_size, "must be >= 2 (advantages compare samples of a group)")
        check(self.temperature > 0, "rl.temperature", self.temperature, "must be > 0 (rollouts are sampled)")
        check(0 <= self.clip_eps_low < 1, "rl.clip_eps_low", self.clip_eps_low, "must be in [0, 1)")
        check(self.clip_eps_high >= 0, "rl.clip_eps_high", self.clip_eps_high, "must be >= 0")
        for name in ("kl_beta", "entropy_coef", "warmup_steps", "eval_interval", "eval_samples"):
            check(getattr(self, name) >= 0, f"rl.{name}", getattr(self, name), "must be >= 0")
        check(self.is_truncation is None or self.is_truncation > 0, "rl.is_truncation", self.is_truncation,
              "must be > 0 or null")
        check(self.reward_clip is None or self.reward_clip > 0, "rl.reward_clip", self.reward_clip, "must be > 0 or null")
        check(self.warmup_lr > 0, "rl.warmup_lr", self.warmup_lr, "must be > 0")
        check(self.engine_kv_cache_memory_mb > 0, "rl.engine_kv_cache_memory_mb", self.engine_kv_cache_memory_mb,
              "must be > 0")
        check(self.eval_temperature > 0, "rl.eval_temperature", self.eval_temperature, "must be > 0")
        check(self.eval_samples == 0 or self.eval_k <= self.eval_samples, "rl.eval_k", self.eval_k,
              f"must be <= rl.eval_samples={self.eval_samples}")
        check(self.backend != "openai" or bool(self.openai_base_url), "rl.openai_base_url", self.openai_base_url,
              "set it to the server's URL (rl.backend is openai)")
        check(self.backend == "openai" or self.openai_base_url is None, "rl.openai_base_url", self.openai_base_url,
              f"is only used with rl.backend=openai (it is {self.backend}): set rl.backend=openai or drop the URL")
        check(self.prompts_per_step * self.group_size >= self.updates_per_step, "rl.updates_per_step",
              self.updates_per_step, "must be <= prompts_per_step * group_size (each mini-batch needs a sequence)")


@dataclass(kw_only=True)
class EnvConfig:
    """RL environments: which ones, their mix, held-out share and task settings."""

    names: list[str] = option(["countdown"], "RL environments: countdown, arithmetic, math (extra 'math'); "
                                             "several are mixed by env.weights")
    weights: list[float] = option([], "Mixing weights, one per name; empty weighs them equally")
    eval_percent: float = option(10.0, "Percent of generated problems held out for evaluation (never trained on)")
    format_reward: float = option(0.0, "Reward of a well-formed answer with the wrong value (countdown)")
    countdown_num_numbers: int = option(3, "Countdown: numbers per problem")
    countdown_max_number: int = option(9, "Countdown: numbers are drawn from 1..this")
    countdown_max_target: int = option(100, "Countdown: largest target")
    countdown_operators: str = option("+-*", "Countdown: operators of the generated expressions, some of '+-*/'")
    arithmetic_num_operations: int = option(2, "Arithmetic: operations per expression")
    arithmetic_max_number: int = option(20, "Arithmetic: operands are drawn from 0..this")
    math_path: Optional[str] = option(None, "Math: JSONL of {problem, answer}; null generates fraction sums")
    train_size: int = option(10_000_000, "Problems in the training stream (generated on demand)")

    def validate(self) -> None:
        check(bool(self.names), "env.names", self.names, "name at least one environment")
        check(not self.weights or len(self.weights) == len(self.names), "env.weights", self.weights,
              f"give one weight per name ({len(self.names)}) or none")
        check(all(w >= 0 for w in self.weights) and (not self.weights or sum(self.weights) > 0), "env.weights",
              self.weights, "weights must be non-negative with a positive sum")
        check(0 < self.eval_percent < 100, "env.eval_percent", self.eval_percent, "must be in (0, 100)")
        check(self.countdown_num_numbers >= 2, "env.countdown_num_numbers", self.countdown_num_numbers, "must be >= 2")
        for name in ("countdown_max_number", "countdown_max_target", "arithmetic_num_operations",
                     "arithmetic_max_number", "train_size"):
            check(getattr(self, name) >= 1, f"env.{name}", getattr(self, name), "must be >= 1")
        check(bool(self.countdown_operators) and set(self.countdown_operators) <= set("+-*/"),
              "env.countdown_operators", self.countdown_operators, "use some of '+-*/'")


@dataclass(kw_only=True)
class RunConfig:
    """Everything a run needs: one section per component (the top-level keys of a YAML config)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    grads: GradsConfig = field(default_factory=GradsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def validate(self, world_size: int = 1) -> None:
        """Check every section, then the fields that depend on each other."""
        for section in SECTIONS:
            getattr(self, section).validate()
        t, m = self.train, self.model
        check(t.global_batch_size % t.micro_batch_size == 0, "train.global_batch_size", t.global_batch_size,
              f"must be a multiple of train.micro_batch_size={t.micro_batch_size}")
        check(self.data.seq_length <= m.max_position_embeddings, "data.seq_length", self.data.seq_length,
              f"must be <= model.max_position_embeddings={m.max_position_embeddings}")
        check(self.scheduler.min_lr <= self.optimizer.lr, "scheduler.min_lr", self.scheduler.min_lr,
              f"must be <= optimizer.lr={self.optimizer.lr} (decay ends at min_lr)")
        p = self.parallel
        others = p.dp_replicate * p.cp * p.tp * p.pp
        if p.dp_shard != -1 or world_size % others == 0:
            product = others * (p.dp_shard if p.dp_shard != -1 else world_size // others)
            check(product == world_size, "parallel", f"product {product}",
                  f"dp_replicate*dp_shard*cp*tp*pp must equal the world size {world_size} (dp_shard -1 fills in)")
        else:
            check(False, "parallel", f"dp_replicate*cp*tp*pp = {others}",
                  f"must divide the world size {world_size}; change the degrees or the number of processes")
        if p.cp > 1:
            check("M" not in m.pattern, "parallel.cp", p.cp, "context parallelism splits the sequence, which Mamba "
                  "sublayers scan from start to end; set parallel.cp 1 for a pattern with 'M'")
            check(self.data.seq_length % (2 * p.cp) == 0, "data.seq_length", self.data.seq_length,
                  f"must be divisible by 2 * parallel.cp = {2 * p.cp} (zig-zag context-parallel chunks)")


SECTIONS = tuple(RunConfig.__dataclass_fields__)
