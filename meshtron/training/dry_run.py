"""`--dry-run` of `meshtron train`, `distill` and `rl`: check what a run needs before it starts, without
building the model or reading the data: the run directory (fresh, resumed, or refused), every input
path (data, tokenizer, checkpoint.load, teacher, init_from_hf), the mesh (the parallel degrees against
the world size, the global batch against micro-batch x data-parallel size) and the memory per rank (the
accounting of `meshtron plan`, on the meta device). Prints a summary and returns 0, or raises the first
problem as one line."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional

from meshtron.config.fields import ConfigError
from meshtron.config.schema import AUTO_LOAD, RunConfig

GIB = 1 << 30


def add_dry_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checking a run without starting it")
    group.add_argument("--dry-run", action="store_true",
                       help="check paths, the mesh and memory per rank, print a summary and exit (nothing is built)")
    group.add_argument("--world-size", type=int, default=None, metavar="N",
                       help="with --dry-run: the number of processes to check for (default: WORLD_SIZE, else 1)")


def dry_run_world_size(args: argparse.Namespace) -> Optional[int]:
    """The world size a dry run checks (None: the WORLD_SIZE of the environment, as a real run)."""
    world = getattr(args, "world_size", None)
    if world is not None and world < 1:
        raise ConfigError(f"--world-size: {world} is not allowed; must be >= 1")
    if world is not None and not getattr(args, "dry_run", False):
        raise ConfigError("--world-size: only a --dry-run takes it; a run's world size is its number of processes")
    return world


def _require(path: Optional[str], field: str, what: str) -> None:
    if path and not Path(path).exists():
        raise ConfigError(f"{field}: {path!r} does not exist; give {what}")


def check_paths(cfg: RunConfig, command: str) -> list[str]:
    """Every input path the run reads exists; -> what was checked, for the summary."""
    checked = []
    if cfg.tokenizer.type != "byte":
        _require(cfg.tokenizer.path, "tokenizer.path", f"the {cfg.tokenizer.type} tokenizer's directory or file")
        checked.append(f"tokenizer {cfg.tokenizer.path}")
    if command == "rl":
        pass   # RL reads prompts from its environments, not data.paths
    elif cfg.data.format == "sft":
        for path in cfg.data.paths:
            _require(path, "data.paths", "a chat jsonl file")
            checked.append(f"data {path}")
    elif cfg.data.paths:
        for prefix in cfg.data.blend()[1]:
            for suffix in (".bin", ".idx"):
                _require(prefix + suffix, "data.paths", f"the prefix of a dataset written by `meshtron preprocess` "
                                                        f"({prefix}.bin and {prefix}.idx)")
            checked.append(f"data {prefix}")
    else:
        checked.append("data: the embedded stdlib corpus")
    if cfg.train.init_from_hf:
        _require(cfg.train.init_from_hf, "train.init_from_hf", "a Hugging Face model directory")
        checked.append(f"init_from_hf {cfg.train.init_from_hf}")
    if cfg.checkpoint.load and cfg.checkpoint.load != AUTO_LOAD:
        from meshtron.checkpoint import resolve_checkpoint

        checked.append(f"checkpoint.load {resolve_checkpoint(cfg.checkpoint.load)}")
    if command == "distill":
        _require(cfg.teacher.load, "teacher.load", "the teacher's checkpoint")
        if not cfg.teacher.load:
            raise ConfigError("teacher.load: distillation needs the teacher's checkpoint; set teacher.load")
        from meshtron.checkpoint import resolve_checkpoint

        checked.append(f"teacher {resolve_checkpoint(cfg.teacher.load)}")
        _require(cfg.teacher.config, "teacher.config", "a YAML file with the teacher's model section")
    return checked


def describe_run_dir(cfg: RunConfig) -> str:
    from meshtron.training.resume import find_resume_point, save_dir
    from meshtron.training.run_dir import check_run_dir, existing_run, save_interval

    check_run_dir(cfg)   # a run over an existing one is refused here, as `train` would refuse it
    found = existing_run(cfg)
    if cfg.checkpoint.load == AUTO_LOAD:
        path, step = find_resume_point(save_dir(cfg))
        start = f"resumes from {path} (step {step})" if path is not None else "starts fresh (no checkpoint yet)"
    elif cfg.checkpoint.load:
        start = f"starts from {cfg.checkpoint.load}"
    else:
        start = "starts fresh"
    where = "an existing run" if found else "a new run"
    interval = save_interval(cfg)
    saves = f"saves every {interval} steps" if interval else "saves at the end only"
    return f"run dir: {cfg.train.run_dir} ({where}); {start}; {saves} into {save_dir(cfg)}"


def device_memory() -> tuple[Optional[int], str]:
    """(bytes one rank may use, what they are): a CUDA device's memory, else None (a CPU run shares RAM)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, props.name
    return None, "cpu"


def dry_run(cfg: RunConfig, command: str, world_size: Optional[int] = None) -> list[str]:
    """The summary lines of a dry run of `command` (train, distill or rl); raises the first problem."""
    from meshtron.models.accounting import count_parameters
    from meshtron.parallel.dims import ParallelDims
    from meshtron.parallel.plan import estimate_memory, num_microbatches, vocab_size
    from meshtron.parallel.plan_command import describe_layout

    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    lines = [describe_run_dir(cfg)]
    lines.append("paths ok: " + (", ".join(check_paths(cfg, command)) or "none to check"))
    dims = ParallelDims.from_config(cfg.parallel, world)
    m = num_microbatches(cfg, dims)
    lines.append(f"mesh: {describe_layout(cfg, world)}; {m} micro-batches of {cfg.train.micro_batch_size} x "
                 f"{cfg.data.seq_length} tokens per rank and step (global batch {cfg.train.global_batch_size})")
    vocab = vocab_size(cfg)
    rows = estimate_memory(cfg, world)
    peak = max(r["total_bytes"] for r in rows)
    n = count_parameters(cfg.model, vocab)
    size = f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    lines.append(f"model: {size} parameters, vocab {vocab}, {cfg.train.train_iters} steps, "
                 f"precision {cfg.train.precision}")
    per_stage = ", ".join(f"stage {r['stage']} {r['total_bytes'] / GIB:.2f}" for r in rows) if len(rows) > 1 else ""
    budget, device = device_memory()
    memory = f"memory per rank (meshtron plan): {peak / GIB:.2f} GiB" + (f" ({per_stage} GiB)" if per_stage else "")
    if budget is not None:
        if peak > budget:
            raise ConfigError(f"parallel: the busiest rank needs ~{peak / GIB:.1f} GiB (meshtron plan) but the "
                              f"{device} has {budget / GIB:.1f} GiB; raise parallel.dp_shard/tp/pp, set "
                              "parallel.activation_checkpoint, or lower train.micro_batch_size")
        memory += f" of the {device}'s {budget / GIB:.1f} GiB"
    if command != "train":
        memory += "; the " + ("teacher" if command == "distill" else "rollout engine and reference model") \
            + " come on top"
    lines.append(memory)
    return lines


def load_for(args: argparse.Namespace, command: str) -> RunConfig:
    """The config of a run command, loaded for the world size a dry run checks (the environment's otherwise)."""
    from meshtron.config.loader import load_config, overrides_from_args

    world = dry_run_world_size(args)
    try:
        return load_config(args.config, overrides_from_args(args), world_size=world)
    except ConfigError as e:
        if getattr(args, "dry_run", False) and world is None and str(e).startswith("parallel"):
            raise ConfigError(f"{e}; a dry run checks the world size given by --world-size N") from None
        raise


def run_dry_run(cfg: RunConfig, command: str, world_size: Optional[int]) -> int:
    for line in dry_run(cfg, command, world_size):
        print(line)
    print(f"dry run: ok; `meshtron {command}` without --dry-run starts the run")
    return 0
