"""Megatron Core torch_dist <-> meshtron checkpoints, one layer's tensor at a time.

megatron-to-meshtron: the model config comes from the run's `args` in the common state (or a meshtron
YAML given with --config); every tensor the config implies is located (stacked or per layer, TE or
local names) and its shape checked, and every model tensor of the checkpoint must have a place, all
before anything is written. Then a model-only meshtron checkpoint (step 0) is written, each
parameter cut from its Megatron tensor when the writer reaches it. Optimizer state, RNG state and
`_extra_state` entries are not converted.

meshtron-to-megatron: a Megatron-LM save directory (`latest_checkpointed_iteration.txt` = release,
`release/` a torch_dist checkpoint) with the GPTModel tensors stacked over layers under the names
megatron-core saves (TE-style norm names, which its local layer spec loads too), empty `_extra_state`
objects for the linears, and a common state holding Megatron-LM `args` for the model.

Both directions build their output beside the target and rename it into place: a failure leaves nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from meshtron.config.loader import config_from_dict, config_to_dict, load_config
from meshtron.config.schema import ModelConfig
from meshtron.models.hf.convert import converted_run_config, meshtron_shapes
from meshtron.models.hf.dcp_io import CheckpointTensors, write_model_checkpoint
from meshtron.models.megatron.dcp_files import TRACKER, MegatronCheckpoint, TensorOut, write_dcp
from meshtron.models.megatron.names import (
    ATTENTION_EXTRA_STATE,
    DENSE_EXTRA_STATE,
    EXPERT_EXTRA_STATE,
    LAYERS_PREFIX,
    SHARED_EXPERT_EXTRA_STATE,
    LayerMap,
    MegatronError,
    args_from_model_config,
    check_supported,
    megatron_shape,
    model_config_from_args,
    piece_maps,
    to_megatron,
    to_meshtron,
)

EMBEDDING = "embedding.word_embeddings.weight"
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.", "mtp_", "position_embeddings.")


def _is_model_tensor(name: str) -> bool:
    return name.startswith(MODEL_PREFIXES) and "_extra_state" not in name


def _locate(ckpt: MegatronCheckpoint, m: LayerMap, num_layers: int) -> tuple[str, Optional[int]]:
    """(tensor name, layer index or None) holding piece `m` in the checkpoint."""
    if m.layer is None:
        return m.piece.megatron, None
    for name in (m.piece.megatron, m.piece.local_name):
        if name is None:
            continue
        stacked = LAYERS_PREFIX + name
        if stacked in ckpt.sizes and ckpt.sizes[stacked][:1] == (num_layers,):
            return stacked, m.layer
        if stacked in ckpt.sizes:
            raise MegatronError(f"{str(ckpt.path)!r}: tensor {stacked!r} stacks {ckpt.sizes[stacked][0]} layers, "
                                f"the config has {num_layers}")
        single = f"{LAYERS_PREFIX}{m.layer}.{name}"
        if single in ckpt.sizes:
            return single, None
    return f"{LAYERS_PREFIX}{m.piece.megatron}", m.layer


def _plan_reads(ckpt: MegatronCheckpoint, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
                maps: list[LayerMap]) -> dict[str, tuple[LayerMap, str, Optional[int]]]:
    """{meshtron parameter: (piece, Megatron tensor, layer)}; every check made before any data is read."""
    num_layers = cfg.pattern.count("*")
    where, used = {}, set()
    for m in maps:
        name, layer = _locate(ckpt, m, num_layers)
        if name not in ckpt.sizes:
            raise MegatronError(f"{str(ckpt.path)!r}: tensor {name!r} is missing (the config implies it)")
        actual = ckpt.sizes[name][1:] if layer is not None else ckpt.sizes[name]
        expected = megatron_shape(m, shapes)
        if tuple(actual) != expected:
            raise MegatronError(f"{str(ckpt.path)!r}: tensor {name!r} has shape {list(actual)} per layer, the config "
                                f"implies {list(expected)}" if layer is not None else
                                f"{str(ckpt.path)!r}: tensor {name!r} has shape {list(actual)}, the config "
                                f"implies {list(expected)}")
        used.add(name)
        for part in m.parts:
            where[part] = (m, name, layer)
    extra = sorted(n for n in ckpt.sizes if _is_model_tensor(n) and n not in used)
    if extra:
        raise MegatronError(f"{str(ckpt.path)!r}: tensor {extra[0]!r} has no place in the converted model "
                            f"({len(extra)} such tensors; an unsupported layer type, or args that do not describe "
                            "these weights)")
    missing = [p for p in shapes if p not in where]
    if missing:
        raise MegatronError(f"the converter has no Megatron tensor for meshtron parameter {missing[0]!r}")
    return where


def _model_config(ckpt: MegatronCheckpoint, config: Optional[str | Path]) -> ModelConfig:
    if EMBEDDING not in ckpt.sizes:
        raise MegatronError(f"{str(ckpt.path)!r} holds no {EMBEDDING}; it is not a Megatron GPTModel checkpoint")
    vocab = ckpt.sizes[EMBEDDING][0]
    if config is not None:
        cfg = load_config(config).model
        cfg = dataclasses.replace(cfg, vocab_size=vocab, make_vocab_size_divisible_by=1)
        cfg.validate()
        return cfg
    args = ckpt.common_state().get("args")
    if args is None or not hasattr(args, "__dict__"):
        raise MegatronError(f"{str(ckpt.path)!r}: the common state holds no Megatron-LM args; "
                            "pass the model with --config MODEL.yaml")
    return model_config_from_args(dict(vars(args)), vocab)


def megatron_to_meshtron(megatron_dir: str | Path, output: str | Path, *, config: Optional[str | Path] = None) -> Path:
    """Convert a torch_dist checkpoint into a meshtron checkpoint `output/step_00000000`; return that step dir."""
    ckpt = MegatronCheckpoint(megatron_dir)
    cfg = _model_config(ckpt, config)
    shapes = meshtron_shapes(cfg)
    where = _plan_reads(ckpt, cfg, shapes, piece_maps(cfg, shapes))
    cached: dict[str, Any] = {"key": None, "parts": {}}

    def produce(name: str) -> torch.Tensor:
        m, tensor_name, layer = where[name]
        if cached["key"] != (tensor_name, layer):
            tensor = ckpt.read(tensor_name, layer).to(torch.float32)
            cached["key"] = (tensor_name, layer)
            cached["parts"] = dict(zip(m.parts, to_meshtron(m, tensor, cfg, shapes)))
        return cached["parts"].pop(name).contiguous()

    run_cfg = converted_run_config(cfg, None)
    state = {"step": 0, "model_only": True, "source": str(ckpt.path.absolute())}
    output = Path(output).absolute()
    return _atomically(output, lambda target: write_model_checkpoint(
        target, 0, {n: (s, torch.float32) for n, s in shapes.items()}, produce, state,
        yaml.safe_dump(config_to_dict(run_cfg), sort_keys=False)), keep_existing=True)


def _atomically(output: Path, write, keep_existing: bool = False):
    """Run write(dir): into a fresh sibling renamed to `output`, or (keep_existing) into an existing
    meshtron save dir, whose step directory the checkpoint writer itself renames into place."""
    if output.exists() and keep_existing and output.is_dir():
        before = set(output.iterdir())
        try:
            return write(output)
        except BaseException:
            for p in set(output.iterdir()) - before:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            raise
    if output.exists():
        raise MegatronError(f"{str(output)!r} exists; give a new directory")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        result = write(tmp)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(str(result).replace(str(tmp), str(output), 1)) if result is not None else output


def meshtron_to_megatron(checkpoint: str | Path, output: str | Path) -> list[str]:
    """Write a Megatron-LM save directory `output` (tracker file + `release/`) from a meshtron checkpoint."""
    tensors = CheckpointTensors(checkpoint)
    run_cfg = config_from_dict(yaml.safe_load((tensors.step_dir / "config.yaml").read_text()))
    if "embedding.weight" not in tensors.shapes:
        raise MegatronError(f"checkpoint {str(tensors.step_dir)!r} holds no model weights (embedding.weight)")
    cfg = dataclasses.replace(run_cfg.model, vocab_size=tensors.shapes["embedding.weight"][0][0],
                              make_vocab_size_divisible_by=1)
    check_supported(cfg)
    expected = meshtron_shapes(cfg)
    shapes = {n: s for n, (s, _) in tensors.shapes.items()}
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            raise MegatronError(f"checkpoint {str(tensors.step_dir)!r}: tensor {name!r} is "
                                f"{'missing' if name not in shapes else f'of shape {list(shapes[name])}'}, its "
                                f"config implies {list(shape)}")
    dtype = tensors.shapes["embedding.weight"][1]
    outs = _tensors_out(cfg, expected, tensors, dtype)
    objects = _extra_states(cfg)
    objects["common_state/shard_0_1"] = {"args": argparse.Namespace(**args_from_model_config(cfg)),
                                         "checkpoint_version": 3.0, "iteration": 0}

    def write(target: Path) -> None:
        (target / "release").mkdir()
        write_dcp(target / "release", outs, objects)
        (target / TRACKER).write_text("release")

    _atomically(Path(output).absolute(), write)
    mapped = {p for m in piece_maps(cfg, expected) for p in m.parts}
    dropped = sorted(n for n in shapes if n not in mapped)
    notes = [f"dropped {len(dropped)} tensors a Megatron GPTModel has no place for (e.g. {dropped[0]}; multi-token "
             "prediction layers are not converted)"] if dropped else []
    return notes + ["optimizer state is not converted: start Megatron-LM with --no-load-optim --no-load-rng "
                    "(or --finetune)"]


def stacked_layout(cfg: ModelConfig) -> bool:
    """Whether megatron-core stacks this model's layers (all alike) or keys them per layer (dense and MoE mixed)."""
    return len(set(cfg.pattern[1::2])) == 1


def _extra_states(cfg: ModelConfig) -> dict[str, Any]:
    """The `_extra_state` objects megatron-core's GPTModel saves (None: the local spec keeps nothing), named
    as its ShardedObjects are: stacked `<key>/shard_<layer>_<layers>` (experts `shard_<layer>.<expert>_<layers>.<experts>`),
    per layer `decoder.layers.<i>.<key>/shard_0_1` (experts `shard_<expert>_<experts>`)."""
    num_layers, experts = cfg.pattern.count("*"), cfg.num_moe_experts or 0
    shared = SHARED_EXPERT_EXTRA_STATE if cfg.moe_shared_expert_intermediate_size else ()
    objects: dict[str, Any] = {}
    for i, mlp in enumerate(cfg.pattern[1::2]):
        modules = ATTENTION_EXTRA_STATE + (shared if mlp == "E" else DENSE_EXTRA_STATE)
        expert_modules = EXPERT_EXTRA_STATE if mlp == "E" else ()
        if stacked_layout(cfg):
            objects.update({f"{LAYERS_PREFIX}{m}._extra_state/shard_{i}_{num_layers}": None for m in modules})
            objects.update({f"{LAYERS_PREFIX}{m}._extra_state/shard_{i}.{e}_{num_layers}.{experts}": None
                            for m in expert_modules for e in range(experts)})
        else:
            objects.update({f"{LAYERS_PREFIX}{i}.{m}._extra_state/shard_0_1": None for m in modules})
            objects.update({f"{LAYERS_PREFIX}{i}.{m}._extra_state/shard_{e}_{experts}": None
                            for m in expert_modules for e in range(experts)})
    return objects


def _tensors_out(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], tensors: CheckpointTensors,
                 dtype: torch.dtype) -> list[TensorOut]:
    """The Megatron tensors with their chunks: one chunk for a global tensor, one per layer for a stacked one."""
    num_layers = cfg.pattern.count("*")
    by_piece: dict[str, list[LayerMap]] = {}
    for m in piece_maps(cfg, shapes):
        by_piece.setdefault(m.piece.megatron, []).append(m)
    outs = []
    for piece_name, maps in by_piece.items():
        per_layer = megatron_shape(maps[0], shapes)

        def chunk(m: LayerMap):
            return lambda: to_megatron(m, [tensors.get(p) for p in m.parts], cfg).to(dtype)

        if maps[0].layer is None:
            outs.append(TensorOut(piece_name, per_layer, dtype, [((0,) * len(per_layer), per_layer, chunk(maps[0]))]))
            continue
        if not stacked_layout(cfg):
            outs.extend(TensorOut(f"{LAYERS_PREFIX}{m.layer}.{piece_name}", per_layer, dtype,
                                  [((0,) * len(per_layer), per_layer, chunk(m))]) for m in maps)
            continue
        assert [m.layer for m in maps] == list(range(num_layers)), piece_name
        outs.append(TensorOut(LAYERS_PREFIX + piece_name, (num_layers, *per_layer), dtype,
                              [((m.layer, *(0,) * len(per_layer)), (1, *per_layer),
                                (lambda f: lambda: f().unsqueeze(0))(chunk(m))) for m in maps]))
    return outs
