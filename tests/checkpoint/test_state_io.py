"""The trainer state is stored as JSON plus safetensors (no pickle) and comes back exactly: the RNG
states continue the same random streams, and every value keeps its type and bits."""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from meshtron.checkpoint.state_io import STATE_JSON, STATE_TENSORS, read_trainer_state, write_trainer_state
from meshtron.training.trainer import rng_state, set_rng_state


def draws() -> tuple:
    """The next numbers of every generator a trainer restores (python, numpy, torch)."""
    return ([random.random() for _ in range(3)], random.gauss(0, 1), np.random.rand(3).tolist(),
            np.random.standard_normal(), torch.rand(3).tolist(), torch.randn(2).tolist())


def test_rng_states_continue_the_same_streams(tmp_path):
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    random.gauss(0, 1)            # leaves a cached second gaussian in python's state
    np.random.standard_normal()   # and in numpy's (has_gauss = 1, cached_gaussian set)
    state = rng_state()
    expected = draws()
    write_trainer_state(tmp_path, {"step": 3, "rng": state})
    for _ in range(5):
        draws()                   # move every stream on
    loaded = read_trainer_state(tmp_path)
    set_rng_state(loaded["rng"])
    assert draws() == expected    # exact equality of floats: the streams are bit for bit the same
    assert loaded["rng"]["python"] == state["python"] and isinstance(loaded["rng"]["python"], tuple)
    key = loaded["rng"]["numpy"][1]
    assert key.dtype == np.uint32 and np.array_equal(key, state["numpy"][1])
    assert torch.equal(loaded["rng"]["torch"], state["torch"])


def test_values_keep_type_and_bits(tmp_path):
    shared = torch.randn(4, 3)
    state = {
        "none": None, "flag": True, "big": 2**70, "neg": -5, "tiny": 5e-324, "third": 1 / 3, "text": "π ü 字",
        "nested": {"list": [1, (2.5, "x"), [None]], "tuple": ((1, 2), ())},
        "bf16": torch.randn(3, dtype=torch.bfloat16), "ids": torch.arange(5), "mask": torch.tensor([True, False]),
        "tied": {"embedding": shared, "output": shared},  # sharing storage, as tied weights do
        "u32": np.arange(4, dtype=np.uint32) * 1_000_000_000, "f64": np.array([0.1, -2.0]),
    }
    write_trainer_state(tmp_path, state)
    loaded = read_trainer_state(tmp_path)
    for key in ("none", "flag", "big", "neg", "tiny", "third", "text", "nested"):
        assert loaded[key] == state[key] and type(loaded[key]) is type(state[key]), key
    assert loaded["nested"]["list"][1] == (2.5, "x") and loaded["nested"]["tuple"] == ((1, 2), ())
    for key in ("bf16", "ids", "mask"):
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key]), key
    assert torch.equal(loaded["tied"]["embedding"], shared) and torch.equal(loaded["tied"]["output"], shared)
    for key in ("u32", "f64"):
        assert loaded[key].dtype == state[key].dtype and np.array_equal(loaded[key], state[key]), key


def test_files_hold_json_and_safetensors_only(tmp_path):
    """No pickle anywhere: the JSON parses as JSON and the tensor file is a safetensors file."""
    from safetensors.torch import load_file

    write_trainer_state(tmp_path, {"step": 2, "rng": rng_state()})
    document = json.loads((tmp_path / STATE_JSON).read_text())
    assert document["format"] == 1 and document["state"]["step"] == 2
    assert document["state"]["rng"]["numpy"]["__tuple__"][0] == "MT19937"
    key = document["state"]["rng"]["torch"]["__tensor__"]  # tensors are named in the JSON
    assert torch.equal(load_file(str(tmp_path / STATE_TENSORS))[key], rng_state()["torch"])
