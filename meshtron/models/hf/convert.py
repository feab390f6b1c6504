"""Hugging Face <-> meshtron conversion, tensor by tensor.

hf-to-meshtron: config.json -> ModelConfig through the family adapter; every expected tensor is
checked (present, no unexpected ones, shapes) from the safetensors headers before any data is
read; then a model-only meshtron checkpoint (step 0) is written, each parameter produced from its
HF tensor when the writer needs it. The HF directory's small files (config.json, tokenizer files,
generation config) are carried into the checkpoint under `hf/`, and the run config's tokenizer
points there when a tokenizer.json is present.

meshtron-to-hf: the adapter writes config.json (the carried one, unchanged, when the architecture
did not change) and the weights as sharded safetensors, each HF tensor assembled from its meshtron
parts as the writer reaches it. Tensors are kept in the checkpoint's dtype (fp32) unless a dtype is
asked for or the carried config names one, so HF -> meshtron -> HF is bit-exact.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from meshtron.checkpoint.carry import (  # noqa: F401 (SIDE_FILE_SUFFIXES: public here before)
    SIDE_FILE_SUFFIXES,
    copy_side_files,
    resolve_tokenizer_path,
    side_files,
)
from meshtron.config.loader import config_from_dict, config_to_dict
from meshtron.config.schema import ModelConfig, RunConfig
from meshtron.models.gpt import GPTModel
from meshtron.models.hf.adapter import (
    ConversionError,
    FamilyAdapter,
    TensorMap,
    adapter_by_name,
    adapter_for_hf,
    architecture_fields,
    guess_family,
    hf_dtype,
)
from meshtron.models.hf.dcp_io import CheckpointTensors, write_model_checkpoint
from meshtron.models.hf.safetensors_io import SafetensorsDir, TensorSpec, read_all, write_sharded

CARRIED_DIR = "hf"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{str(hf_dir)!r} has no config.json; give a Hugging Face model directory")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConversionError(f"{str(path)!r} holds a {type(hf).__name__}, not a JSON object")
    return hf


def meshtron_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of GPTModel(cfg), built on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPTModel(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_hf_tensors(maps: list[TensorMap], view: SafetensorsDir, shapes: dict[str, tuple[int, ...]],
                     adapter: FamilyAdapter) -> None:
    """Every mapped tensor present with the right shape, and nothing unexpected (one line each)."""
    where = str(view.directory)
    mapped = {m.hf for m in maps}
    keys = set(view.keys())
    missing = [m.hf for m in maps if m.hf not in keys]
    if missing:
        raise ConversionError(f"{where}: tensor {missing[0]!r} is missing for {adapter.architecture} "
                              f"({len(missing)} missing in all)")
    unexpected = sorted(k for k in keys if k not in mapped and not adapter.ignored(k))
    if unexpected:
        raise ConversionError(f"{where}: unexpected tensor {unexpected[0]!r} for {adapter.architecture} "
                              f"({len(unexpected)} unexpected in all); the config does not describe these weights")
    for m in maps:
        expected = m.hf_shape([shapes[p] for p in m.parts])
        if view.shape(m.hf) != expected:
            raise ConversionError(f"{where}: tensor {m.hf!r} has shape {list(view.shape(m.hf))}, "
                                  f"expected {list(expected)} from config.json")


class _PartSource:
    """Meshtron parameters cut from HF tensors, keeping the last HF tensor for its sibling parts;
    a stacked parameter (experts) is assembled from its per-entry HF tensors (indexed maps)."""

    def __init__(self, maps: list[TensorMap], shapes: dict[str, tuple[int, ...]], get_hf):
        self._where = {p: (m, i) for m in maps if m.index is None for i, p in enumerate(m.parts)}
        self._stacked: dict[str, list[TensorMap]] = {}
        for m in maps:
            if m.index is not None:
                self._stacked.setdefault(m.parts[0], []).append(m)
        self._shapes, self._get_hf = shapes, get_hf
        self._cached: tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

    def covers(self, name: str) -> bool:
        return name in self._where or name in self._stacked

    def __call__(self, name: str) -> torch.Tensor:
        if name in self._stacked:
            entries = sorted(self._stacked[name], key=lambda m: m.index)
            assert [m.index for m in entries] == list(range(self._shapes[name][0])), name
            return torch.stack([m.to_meshtron(self._get_hf(m.hf), [])[0].to(torch.float32) for m in entries])
        m, i = self._where[name]
        if self._cached[0] != m.hf:
            self._cached = (m.hf, self._get_hf(m.hf))
        sizes = [self._shapes[p][m.dim] for p in m.parts]  # split sizes in meshtron orientation
        part = m.to_meshtron(self._cached[1], sizes)[i]
        if i == len(m.parts) - 1:
            self._cached = (None, None)
        # a view into a fused HF tensor is compacted by the DCP writer; a whole fp32 tensor is used as is
        return part.to(torch.float32)


def converted_run_config(model_cfg: ModelConfig, tokenizer_dir: Optional[Path]) -> RunConfig:
    cfg = RunConfig()
    cfg.model = model_cfg
    cfg.data.seq_length = min(cfg.data.seq_length, model_cfg.max_position_embeddings)
    if tokenizer_dir is not None:
        cfg.tokenizer.type, cfg.tokenizer.path = "hf", str(tokenizer_dir)
    return cfg


def _usable_tokenizer(directory: Path) -> bool:
    """Whether meshtron's hf tokenizer loads the carried files (needs tokenizer.json and an end token)."""
    if not (directory / "tokenizer.json").is_file():
        return False
    from meshtron.config.fields import ConfigError
    from meshtron.config.schema import TokenizerConfig
    from meshtron.data.tokenizer import build_tokenizer

    try:
        build_tokenizer(TokenizerConfig(type="hf", path=str(directory)))
    except (ConfigError, OSError, ValueError):
        return False
    return True


def hf_to_meshtron(hf_dir: str | Path, output: str | Path, *, streaming: bool = True) -> Path:
    """Convert a Hugging Face model directory into a meshtron checkpoint under `output`; return the step dir."""
    hf_dir, output = Path(hf_dir), Path(output).absolute()
    hf = read_hf_config(hf_dir)
    adapter = adapter_for_hf(hf)
    cfg = adapter.to_model_config(hf)
    cfg.validate()
    view = SafetensorsDir(hf_dir)
    maps = adapter.tensor_maps(cfg, set(view.keys()))
    shapes = meshtron_shapes(cfg)
    check_hf_tensors(maps, view, shapes, adapter)
    source = _PartSource(maps, shapes, view.get)
    uncovered = [n for n in shapes if not source.covers(n)]
    assert not uncovered, f"adapter {adapter.name} leaves {uncovered} unmapped"
    if not streaming:  # the baseline: every tensor in memory, then a full model
        tensors = read_all(hf_dir)
        model = GPTModel(cfg)
        cut = _PartSource(maps, shapes, tensors.__getitem__)
        model.load_state_dict({n: cut(n) for n in shapes})
        state = model.state_dict()
        source = state.__getitem__
    # the config names the carried files relative to the step directory (checkpoint/carry.py)
    run_cfg = converted_run_config(cfg, Path(CARRIED_DIR) if _usable_tokenizer(hf_dir) else None)

    def fill(path: Path) -> None:
        copy_side_files(hf_dir, path)

    return write_model_checkpoint(
        output, 0, {n: (s, torch.float32) for n, s in shapes.items()}, source,
        {"step": 0, "model_only": True, "source": str(hf_dir.absolute())},
        yaml.safe_dump(config_to_dict(run_cfg), sort_keys=False), extra_dirs={CARRIED_DIR: fill})


def _export_config(carried: Optional[dict[str, Any]], adapter: FamilyAdapter, cfg: ModelConfig) -> dict[str, Any]:
    """The carried config.json unchanged when it still describes `cfg`; else the adapter's fields over it."""
    derived = adapter.to_hf_config(cfg)
    if carried is not None and adapter_for_hf(carried).name == adapter.name:
        try:
            same = architecture_fields(adapter.to_model_config(carried)) == architecture_fields(cfg)
        except ConversionError:
            same = False
        if same:
            return dict(carried)
        stale = ("rope_theta", "rope_scaling")  # older spellings that rope_parameters replaces
        return {**{k: v for k, v in carried.items() if k not in stale}, **derived}
    return derived


def meshtron_to_hf(checkpoint: str | Path, output: str | Path, *, architecture: Optional[str] = None,
                   dtype: Optional[str] = None, max_shard_bytes: int = 5 * 2**30, streaming: bool = True) -> list[str]:
    """Write `output/config.json` and sharded safetensors from a meshtron checkpoint.

    Returns notes for the user (e.g. dropped MTP weights). dtype: 'fp32', 'bf16', 'fp16' or None
    (the carried config's dtype, else fp32).
    """
    tensors = CheckpointTensors(checkpoint)
    run_cfg = config_from_dict(yaml.safe_load((tensors.step_dir / "config.yaml").read_text()))
    run_cfg.tokenizer.path = resolve_tokenizer_path(run_cfg.tokenizer.path, tensors.step_dir)  # carried: relative
    if "embedding.weight" not in tensors.shapes:
        raise ConversionError(f"checkpoint {str(tensors.step_dir)!r} holds no model weights (embedding.weight)")
    vocab = tensors.shapes["embedding.weight"][0][0]
    cfg = dataclasses.replace(run_cfg.model, vocab_size=vocab, make_vocab_size_divisible_by=1)
    carried_dir = tensors.step_dir / CARRIED_DIR
    carried = json.loads((carried_dir / "config.json").read_text()) if (carried_dir / "config.json").is_file() else None
    adapter = (adapter_by_name(architecture) if architecture else
               adapter_for_hf(carried) if carried is not None else guess_family(cfg))
    hf_cfg = _export_config(carried, adapter, cfg)
    out_dtype = DTYPES[dtype] if dtype else (hf_dtype(hf_cfg) or torch.float32)
    if hf_dtype(hf_cfg) != out_dtype:
        hf_cfg = {k: v for k, v in hf_cfg.items() if k != "torch_dtype"}
        hf_cfg["dtype"] = DTYPE_NAMES[out_dtype]
    maps = adapter.tensor_maps(cfg)
    mapped = {p for m in maps for p in m.parts}
    absent = [p for p in sorted(mapped) if p not in tensors.shapes]
    if absent:
        raise ConversionError(f"checkpoint {str(tensors.step_dir)!r} lacks tensor {absent[0]!r} that "
                              f"{adapter.architecture} needs ({len(absent)} missing in all)")
    dropped = sorted(n for n in tensors.shapes if n not in mapped)
    notes = [f"dropped {len(dropped)} tensors {adapter.architecture} has no place for "
             f"(e.g. {dropped[0]}: multi-token prediction is meshtron-only)"] if dropped else []
    get = functools.lru_cache(maxsize=1)(tensors.get)  # consecutive per-expert tensors share one stacked part
    if not streaming:  # the baseline: the whole model in memory first
        everything = {n: tensors.get(n) for n in mapped}
        get = everything.__getitem__
    specs = [TensorSpec(m.hf, m.hf_shape([tensors.shapes[p][0] for p in m.parts]), out_dtype) for m in maps]
    by_name = {m.hf: m for m in maps}

    def produce(spec: TensorSpec) -> torch.Tensor:
        m = by_name[spec.name]
        return m.to_hf([get(p) for p in m.parts]).to(out_dtype).contiguous()

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    for stale in output.glob("model*.safetensors*"):
        stale.unlink()
    write_sharded(output, specs, produce, max_shard_bytes)
    (output / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    notes += _carry_side_files(carried_dir, run_cfg, output)
    return notes


def _carry_side_files(carried_dir: Path, run_cfg: RunConfig, output: Path) -> list[str]:
    """Tokenizer and generation files: from the checkpoint's hf/ dir, else from an hf tokenizer path."""
    source = carried_dir if carried_dir.is_dir() else None
    if source is None and run_cfg.tokenizer.type == "hf" and run_cfg.tokenizer.path:
        path = Path(run_cfg.tokenizer.path)
        source = path if path.is_dir() else path.parent
    if source is None or not source.is_dir():
        return [f"no tokenizer files carried over (tokenizer.type is {run_cfg.tokenizer.type})"]
    for f in side_files(source):
        if f.name != "config.json":
            shutil.copy2(f, output / f.name)
    return []
