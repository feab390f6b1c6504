"""The trainer state of a checkpoint (step, data position, RNG states, counters) in two files that
hold no code: `trainer_state.json` for plain values and `trainer_state.safetensors` for tensors.

Encoding, lossless for what trainers save: None, bool, int, float (repr round-trips exactly), str,
lists and dicts with string keys as themselves; a tuple as {"__tuple__": [...]}; a torch tensor as
{"__tensor__": key} and a numpy array as {"__ndarray__": key, "dtype": name}, their data under `key`
in the safetensors file (integer arrays as int64, so uint32 RNG keys survive unchanged).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtron.checkpoint.layout import CheckpointError

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
TAGS = ("__tuple__", "__tensor__", "__ndarray__")
STATE_FORMAT = 1


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        assert math.isfinite(value), f"trainer state holds a non-finite float {value}"
        return value
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        # a private, contiguous copy: safetensors refuses tensors that share storage (tied weights)
        tensors[key] = value.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        key = f"t{len(tensors)}"
        data = value.astype(np.int64) if value.dtype.kind in "iu" else value
        assert value.dtype.kind in "iufb" and np.array_equal(data, value), f"array of {value.dtype} not storable"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(data)).clone()
        return {"__ndarray__": key, "dtype": value.dtype.str}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        assert all(isinstance(k, str) and k not in TAGS for k in value), f"keys {list(value)} not storable"
        return {k: _encode(v, tensors) for k, v in value.items()}
    raise TypeError(f"trainer state holds a {type(value).__name__}, which a checkpoint does not store")


def write_trainer_state(directory: Path, state: dict[str, Any]) -> None:
    """trainer_state.json and trainer_state.safetensors in `directory`."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, tensors)
    save_file(tensors, str(directory / STATE_TENSORS))
    (directory / STATE_JSON).write_text(json.dumps({"format": STATE_FORMAT, "state": encoded}))


class _Malformed(Exception):
    pass


def _decode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        raise _Malformed(f"{where} is a {type(value).__name__}")
    tag = [k for k in value if k in TAGS]
    if not tag:
        return {k: _decode(v, tensors, f"{where}.{k}") for k, v in value.items()}
    if tag == ["__tuple__"]:
        if len(value) != 1 or not isinstance(value["__tuple__"], list):
            raise _Malformed(f"{where} is not a valid tagged value ({sorted(value)})")
        return tuple(_decode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value["__tuple__"]))
    key = value.get(tag[0])
    if not isinstance(key, str) or key not in tensors:
        raise _Malformed(f"{where} names tensor {key!r}, which {STATE_TENSORS} does not hold")
    if tag == ["__tensor__"] and len(value) == 1:
        return tensors[key]
    if tag == ["__ndarray__"] and set(value) == {"__ndarray__", "dtype"} and isinstance(value["dtype"], str):
        try:
            dtype = np.dtype(value["dtype"])
        except TypeError:
            raise _Malformed(f"{where} has dtype {value['dtype']!r}") from None
        if dtype.kind not in "iufb":
            raise _Malformed(f"{where} has dtype {value['dtype']!r}")
        return tensors[key].numpy().astype(dtype)
    raise _Malformed(f"{where} is not a valid tagged value ({sorted(value)})")


def read_trainer_state(step_dir: Path) -> dict[str, Any]:
    """The trainer state of `step_dir`; a malformed file is a CheckpointError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(step_dir / STATE_TENSORS))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {STATE_TENSORS} is unreadable ({e})") from None
    try:
        document = json.loads((step_dir / STATE_JSON).read_text())
        if not isinstance(document, dict) or document.get("format") != STATE_FORMAT:
            raise _Malformed(f"it must be an object with \"format\": {STATE_FORMAT} and \"state\"")
        state = _decode(document.get("state"), tensors, "state")
        if not isinstance(state, dict):
            raise _Malformed("'state' must be an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, _Malformed, RecursionError) as e:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {STATE_JSON} is malformed ({e})") from None
    return state
