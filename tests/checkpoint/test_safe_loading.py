"""Loading a checkpoint runs no code from its files (issue 16). Each attack is a step directory an
attacker crafted with its manifest rewritten to match (sizes and hashes), so only the loader's
refusal to unpickle stands in the way; each would create a marker file if its payload ran.

These tests use only names that existed before the fix (CheckpointManager.save, load_checkpoint,
`meshtron generate`), so they run against the old code too, where every one of them fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from meshtron.checkpoint import CheckpointError, CheckpointManager, load_checkpoint
from meshtron.checkpoint.manager import model_optimizer_state


class Payload:
    """Pickles to a call of os.system: unpickling it runs the shell command."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def rewrite_manifest(step_dir: Path) -> None:
    """What the attacker does after swapping files: list every file with its real size (and sha256
    when the manifest records hashes), so the manifest check alone passes."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    hashed = manifest.get("format", 1) >= 2
    files = {}
    for f in sorted(step_dir.rglob("*")):
        name = str(f.relative_to(step_dir))
        if f.is_file() and name != "manifest.json":
            size = f.stat().st_size
            files[name] = {"size": size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()} if hashed else size
    manifest["files"] = files
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def small_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def craft_metadata(step_dir: Path, marker: Path) -> None:
    (step_dir / ".metadata").write_bytes(pickle.dumps(Payload(f"touch {marker}")))
    rewrite_manifest(step_dir)


def craft_trainer_state(step_dir: Path, marker: Path) -> None:
    """The pre-fix format: trainer_state.pt, a torch.save pickle, in place of whatever state is there."""
    for name in ("trainer_state.json", "trainer_state.safetensors", "trainer_state.pt"):
        (step_dir / name).unlink(missing_ok=True)
    torch.save({"step": 1, "boom": Payload(f"touch {marker}")}, step_dir / "trainer_state.pt")
    rewrite_manifest(step_dir)


def craft_optimizer_value(step_dir: Path, model, opt, marker: Path) -> None:
    """DCP stores non-tensor values (optimizer settings such as lr) as torch.save bytes in the .distcp
    files; DCP's default planner reads them back with torch.load(weights_only=False)."""
    state = model_optimizer_state(model, opt)
    lr_key = next(k for k in state["optimizer"] if k.endswith(".lr"))
    state["optimizer"][lr_key] = Payload(f"touch {marker}")
    for f in step_dir.glob("*.distcp"):
        f.unlink()
    with warnings.catch_warnings():  # DCP: no process group, and the directory exists; both intended
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(step_dir))
    rewrite_manifest(step_dir)


def saved(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    model, opt = small_model()
    CheckpointManager(tmp_path / "ck").save(1, model, opt, {"step": 1}, "model: {}\n")
    return tmp_path / "ck" / "step_00000001", model, opt


@pytest.mark.parametrize("attack", ["metadata", "trainer_state", "optimizer_value"])
def test_crafted_step_directory_runs_nothing(tmp_path, attack):
    step_dir, model, opt = saved(tmp_path)
    marker = tmp_path / "pwned"
    if attack == "metadata":
        craft_metadata(step_dir, marker)
    elif attack == "trainer_state":
        craft_trainer_state(step_dir, marker)
    else:
        craft_optimizer_value(step_dir, model, opt, marker)
    fresh, fresh_opt = small_model()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "ck", fresh, fresh_opt)
    assert not marker.exists(), "the checkpoint's payload ran"
    message = str(err.value)
    assert "\n" not in message
    expected = {"metadata": ["posix.system", ".metadata"],  # the file and the class refused
                "trainer_state": ["trainer_state.pt holds posix.system"],
                "optimizer_value": [".lr", "plain data"]}[attack]
    assert all(part in message for part in expected), message


def gpt_checkpoint(tmp_path: Path, tiny_config) -> Path:
    """A real model checkpoint that `meshtron generate` can serve (built directly: no training needed)."""
    from meshtron.config.loader import config_to_dict
    from meshtron.data.tokenizer import build_tokenizer
    from meshtron.models.gpt import GPTModel

    cfg = tiny_config()
    model = GPTModel(cfg.model, build_tokenizer(cfg.tokenizer).vocab_size)
    CheckpointManager(tmp_path / "ck").save(0, model, None, {"step": 0}, yaml.safe_dump(config_to_dict(cfg)))
    return tmp_path / "ck"


def generate(checkpoint: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtron", "generate", "--checkpoint", str(checkpoint),
                           "--prompt", "ab", "--max-new-tokens", "2", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_generate_from_crafted_checkpoint_runs_nothing(tmp_path, tiny_config):
    """The issue's report: a step directory with a pickle payload (manifest sizes rewritten) ran a shell
    command under `meshtron generate`. Now the command stops with one line and the payload never runs;
    the untouched checkpoint still generates."""
    ck = gpt_checkpoint(tmp_path, tiny_config)
    ok = generate(ck)
    assert ok.returncode == 0 and ok.stdout.startswith("ab"), ok.stderr
    for craft in (craft_metadata, craft_trainer_state):
        crafted = tmp_path / f"crafted_{craft.__name__}"
        crafted.mkdir()
        os.system(f"cp -r {ck / 'step_00000000'} {crafted / 'step_00000000'}")
        marker = tmp_path / f"pwned_{craft.__name__}"
        craft(crafted / "step_00000000", marker)
        result = generate(crafted / "step_00000000")
        assert not marker.exists(), f"{craft.__name__}: the payload ran under meshtron generate"
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
