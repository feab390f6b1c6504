"""A damaged or malformed checkpoint is refused in one line naming what is wrong, before anything is
loaded: same-size corruption (sha256), manifests with wrong JSON types or paths leading out, a
`latest` that leaves its save directory, garbled `.metadata` and trainer state; HF index files
whose weight_map leaves its directory; hashes written by every rank of a multi-rank save."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint import CheckpointError, CheckpointManager, load_checkpoint, read_checkpoint_config
from meshtron.checkpoint.manager import step_dir_name
from meshtron.testing.multiprocess import rank_backend, rank_device, run_ranks
from tests.checkpoint.test_safe_loading import rewrite_manifest, small_model


@pytest.fixture
def ck(tmp_path) -> Path:
    model, opt = small_model()
    CheckpointManager(tmp_path / "ck").save(1, model, opt, {"step": 1, "rng": torch.get_rng_state()}, "model: {}\n")
    return tmp_path / "ck"


def refused(path, match: str) -> str:
    """Load into a fresh model: one CheckpointError line containing `match`, and the model untouched."""
    fresh, fresh_opt = small_model()
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, fresh, fresh_opt)
    message = str(err.value)
    assert "\n" not in message and match in message, message
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    return message


def test_manifest_records_the_sha256_of_every_file(ck):
    step_dir = ck / step_dir_name(1)
    files = json.loads((step_dir / "manifest.json").read_text())["files"]
    on_disk = sorted(str(f.relative_to(step_dir)) for f in step_dir.rglob("*") if f.is_file())
    assert sorted(files) == [n for n in on_disk if n != "manifest.json"]
    for name, entry in files.items():
        data = (step_dir / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_same_size_corruption_is_refused_by_name(ck):
    """Random bytes inside a .distcp keep its size; before hashes the load went through (loss NaN)."""
    shard = ck / step_dir_name(1) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[200:264] = os.urandom(64)
    shard.write_bytes(bytes(data))
    refused(ck, "is corrupt: __0_0.distcp does not match the sha256")


@pytest.mark.parametrize("content, match", [
    ("../elsewhere\n", "not the name of a step directory"),
    ("/etc\n", "not the name of a step directory"),
    ("", "not the name of a step directory"),
    ("step_00000001\nstep_00000002\n", "not the name of a step directory"),
    (b"\xff\xfe\x00", "'latest' is unreadable"),
    ("step_00000009\n", "named by 'latest' is missing"),
])
def test_latest_must_name_a_directory_inside(ck, content, match):
    latest = ck / "latest"
    latest.write_bytes(content if isinstance(content, bytes) else content.encode())
    refused(ck, match)


def test_latest_may_not_follow_a_link_out(ck, tmp_path):
    outside = tmp_path / "outside"
    os.rename(ck / step_dir_name(1), outside)  # a complete checkpoint, but outside the save directory
    os.symlink(outside, ck / "step_00000002")
    (ck / "latest").write_text("step_00000002\n")
    refused(ck, "a link to a directory outside the save directory")


MALFORMED_MANIFESTS = [
    ("[]", "must be a JSON object with a 'files' object"),
    ('{"files": []}', "must be a JSON object with a 'files' object"),
    ('{"files": {}, "step": "1"}', "'step' is '1'"),
    ('{"format": 7, "files": {}}', "format 7"),
    ('{"format": 2, "files": {"config.yaml": 12}}', 'the entry of config.yaml must be {"size"'),
    ('{"format": 2, "files": {"config.yaml": {"size": "12", "sha256": "00"}}}', "the entry of config.yaml"),
    ('{"files": {"config.yaml": {"size": 12}}}', "the entry of config.yaml must be a size in bytes"),
    ('{"format": 2, "files": {"../x": {"size": 1, "sha256": "' + "0" * 64 + '"}}}', "'../x' is not a plain path"),
    ('{"format": 2, "files": {"/etc/passwd": {"size": 1, "sha256": "' + "0" * 64 + '"}}}', "is not a plain path"),
    ('{"files": ', "unreadable manifest.json"),
]


@pytest.mark.parametrize("text, match", MALFORMED_MANIFESTS)
def test_malformed_manifest_is_one_line(ck, text, match):
    (ck / step_dir_name(1) / "manifest.json").write_text(text)
    refused(ck, match)
    with pytest.raises(CheckpointError, match="manifest"):
        read_checkpoint_config(ck)


def test_manifest_entry_linking_out_is_refused(ck, tmp_path):
    step_dir = ck / step_dir_name(1)
    secret = tmp_path / "secret"
    secret.write_text("x" * 12)
    (step_dir / "config.yaml").unlink()
    os.symlink(secret, step_dir / "config.yaml")
    rewrite_manifest(step_dir)
    refused(ck, "config.yaml is a link to a file outside the checkpoint")


@pytest.mark.parametrize("data, match", [
    (b"\x80\x04\x95", "is not usable DCP metadata"),                      # truncated pickle
    (b"not a pickle at all", "is not usable DCP metadata"),
    (pickle.dumps([1, 2, 3]), "it holds a list, not DCP's Metadata"),
    (pickle.dumps({"a": 1}), "it holds a dict"),
    (pickle.dumps(print), "refers to builtins.print"),
    (pickle.dumps(os.getcwd), "refers to posix.getcwd"),
])
def test_malformed_metadata_is_one_line(ck, data, match):
    step_dir = ck / step_dir_name(1)
    (step_dir / ".metadata").write_bytes(data)
    rewrite_manifest(step_dir)
    message = refused(ck, match)
    assert ".metadata" in message


def test_metadata_naming_a_file_outside_the_manifest_is_refused(ck):
    """DCP reads each item from the file its metadata names: that file must be one the manifest covers."""
    from meshtron.checkpoint.dcp_safe import _MetadataUnpickler

    step_dir = ck / step_dir_name(1)
    path = step_dir / ".metadata"
    metadata = _MetadataUnpickler(path.read_bytes(), path).load()
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    path.write_bytes(pickle.dumps(metadata))
    rewrite_manifest(step_dir)
    refused(ck, "which is not a file listed in the checkpoint's manifest")


def test_metadata_asking_for_transforms_is_refused(ck):
    from meshtron.checkpoint.dcp_safe import _MetadataUnpickler

    step_dir = ck / step_dir_name(1)
    path = step_dir / ".metadata"
    metadata = _MetadataUnpickler(path.read_bytes(), path).load()
    next(iter(metadata.storage_data.values())).transform_descriptors = ["zstd"]
    path.write_bytes(pickle.dumps(metadata))
    rewrite_manifest(step_dir)
    refused(ck, "asks for storage transforms ['zstd']")


def test_plain_value_where_a_tensor_belongs_is_one_line(ck):
    """A crafted checkpoint may store a weight as a plain value (DCP bytes): refused, not a traceback."""
    import torch.distributed.checkpoint as dcp

    from meshtron.checkpoint.manager import model_optimizer_state

    step_dir = ck / step_dir_name(1)
    model, opt = small_model()
    state = model_optimizer_state(model, opt)
    state["model"]["0.weight"] = 3
    for f in step_dir.glob("*.distcp"):
        f.unlink()
    with pytest.warns(UserWarning):  # DCP: no process group, and the directory exists
        dcp.save(state, checkpoint_id=str(step_dir))
    rewrite_manifest(step_dir)
    refused(ck, "does not match this model")


@pytest.mark.parametrize("name, data, match", [
    ("trainer_state.json", b"{", "trainer_state.json is malformed"),
    ("trainer_state.json", b"[]", "trainer_state.json is malformed"),
    ("trainer_state.json", b'{"format": 1, "state": 5}', "'state' must be an object"),
    ("trainer_state.json", b'{"format": 1, "state": {"rng": {"__tensor__": "t99"}}}', "does not hold"),
    ("trainer_state.json", b'{"format": 1, "state": {"a": {"__ndarray__": "t0", "dtype": "O"}}}', "has dtype 'O'"),
    ("trainer_state.json", b'{"format": 1, "state": {"a": {"__tuple__": 3}}}', "not a valid tagged value"),
    ("trainer_state.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}", "trainer_state.safetensors is unreadable"),
])
def test_malformed_trainer_state_is_one_line(ck, name, data, match):
    step_dir = ck / step_dir_name(1)
    (step_dir / name).write_bytes(data)
    rewrite_manifest(step_dir)
    refused(ck, match)


def test_trainer_state_of_wrong_shape_is_one_line_in_the_trainer(tiny_config, tmp_path):
    """The trainer applies the loaded state inside trainer_state_errors: a field of the wrong type is
    one line naming the checkpoint, not a traceback."""
    from meshtron.training import Trainer

    cfg = tiny_config(**{"train.train_iters": "1", "checkpoint.save": str(tmp_path / "ck")})
    Trainer(cfg).train()
    step_dir = tmp_path / "ck" / step_dir_name(1)
    document = json.loads((step_dir / "trainer_state.json").read_text())
    document["state"]["rng"]["python"] = "not a state"
    (step_dir / "trainer_state.json").write_text(json.dumps(document))
    rewrite_manifest(step_dir)
    with pytest.raises(CheckpointError, match="its trainer state does not fit this trainer") as err:
        Trainer(tiny_config(**{"checkpoint.load": str(tmp_path / "ck")}))
    assert "\n" not in str(err.value)


# ---- Hugging Face index files ---------------------------------------------------------------------

def hf_dir(tmp_path: Path, weight_map: object) -> Path:
    from meshtron.models.hf.safetensors_io import TensorSpec, write_sharded

    directory = tmp_path / "hf"
    write_sharded(directory, [TensorSpec("w", (2,), torch.float32)], lambda spec: torch.ones(2), 1 << 20)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.mark.parametrize("weight_map, match", [
    ({"w": "../model-00001-of-00001.safetensors"}, "not a file inside the model directory"),
    ({"w": "/etc/passwd"}, "not a file inside the model directory"),
    ({"w": 3}, "not a file inside the model directory"),
    ([], "has no 'weight_map' object"),
])
def test_hf_index_weight_map_stays_inside(tmp_path, weight_map, match):
    from meshtron.models.hf.safetensors_io import SafetensorsDir, SafetensorsError

    directory = hf_dir(tmp_path, weight_map)
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes((directory / "model-00001-of-00001.safetensors")
                                                                .read_bytes())
    with pytest.raises(SafetensorsError, match=match) as err:
        SafetensorsDir(directory)
    assert "\n" not in str(err.value)


def test_hf_index_link_out_is_refused_and_plain_index_reads(tmp_path):
    from meshtron.models.hf.safetensors_io import SafetensorsDir, SafetensorsError

    directory = hf_dir(tmp_path, {"w": "model-00001-of-00001.safetensors"})
    assert torch.equal(SafetensorsDir(directory).get("w"), torch.ones(2))
    os.rename(directory / "model-00001-of-00001.safetensors", tmp_path / "outside.safetensors")
    os.symlink(tmp_path / "outside.safetensors", directory / "model-00001-of-00001.safetensors")
    with pytest.raises(SafetensorsError, match="not a file inside the model directory"):
        SafetensorsDir(directory)


# ---- several ranks --------------------------------------------------------------------------------

def rank_model():
    """`small_model` on this rank's device (the GPU under MESHTRON_TEST_BACKEND=nccl)."""
    torch.manual_seed(0)
    device = rank_device()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4, device=device)).sum().backward()
    opt.step()
    return model, opt


def save_on_ranks(rank: int, world_size: int, save_dir: str) -> list[str]:
    """Every rank saves its shards and hashes its own, and loads; then rank 1's shard is damaged and
    every rank loads again: all refuse alike, although each hashed only its share of the files."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(rank_backend(), timeout=timedelta(seconds=60))
    outcomes = []
    try:
        model, opt = rank_model()
        CheckpointManager(save_dir, timeout_s=60).save(1, model, opt, {"step": 1}, "model: {}\n")
        for corrupt in (False, True):
            dist.barrier()
            if corrupt and rank == 0:
                shard = Path(save_dir) / step_dir_name(1) / "__1_0.distcp"
                data = bytearray(shard.read_bytes())
                data[100] ^= 0xFF
                shard.write_bytes(bytes(data))
            dist.barrier()
            try:
                load_checkpoint(save_dir, *rank_model())
                outcomes.append("loaded")
            except CheckpointError as e:
                outcomes.append(str(e))
    finally:
        dist.destroy_process_group()
    return outcomes


def test_two_ranks_hash_their_shards_and_verify_together(tmp_path):
    results = run_ranks("tests.checkpoint.test_integrity:save_on_ranks", 2, timeout_s=120, save_dir=str(tmp_path / "ck"))
    for loaded, corrupt in results:
        assert loaded == "loaded" and "is corrupt: __1_0.distcp does not match" in corrupt, (loaded, corrupt)
    step_dir = tmp_path / "ck" / step_dir_name(1)
    shard = step_dir / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # undo the damage: the hash rank 1 recorded is that of what it wrote
    shard.write_bytes(bytes(data))
    files = json.loads((step_dir / "manifest.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(files)
    for name, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((step_dir / name).read_bytes()).hexdigest(), name
