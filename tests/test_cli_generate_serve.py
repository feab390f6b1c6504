"""`meshtron generate` and `serve` on a checkpoint: it works from any working directory (the tokenizer
travels inside it, named relatively), `--tokenizer` replaces it, older checkpoints that name the
tokenizer by a working-directory path still load; an empty prompt samples from the start of a
document; a run directory given as --checkpoint names its checkpoints dir; a port in use is one line;
serve's start-up line reports the model, dtype, KV cache and length limits."""

from __future__ import annotations

import json
import socket

import pytest
import yaml

from meshtron.cli import main, serve_summary
from tests.conftest import TINY

TEXT = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n    y: int\n",
        "for i in range(10):\n    print(i * i)\n", "import os\nprint(os.getcwd())\n"] * 8


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained with an hf tokenizer and data named relative to the working directory,
    as a user writes them in a config: base/{tok, data, run}."""
    from meshtron.data.tokenizer_train import train_bpe

    base = tmp_path_factory.mktemp("base")
    (base / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT))
    train_bpe([str(base / "docs.jsonl")], 300, base / "tok")
    mp = pytest.MonkeyPatch()
    mp.chdir(base)
    try:
        assert main(["preprocess", "--input", "docs.jsonl", "--tokenizer", "tok", "--output-prefix", "data/ds",
                     "--append-eod", "--no-progress"]) == 0
        flags = [arg for k, v in {**TINY, "train.train_iters": "2"}.items() for arg in (f"--{k}", v)]
        assert main(["train", *flags, "--tokenizer.type", "hf", "--tokenizer.path", "tok", "--data.paths",
                     "[data/ds]", "--data.split", "1,1,0", "--train.run_dir", "run"]) == 0
    finally:
        mp.undo()
    return base


class Result:
    def __init__(self, returncode: int, out: str, err: str):
        self.returncode, self.stdout, self.stderr = returncode, out, err


@pytest.fixture
def generate(capsys):
    """generate(checkpoint, *flags) -> the exit code and output of `meshtron generate` (greedy, 8 tokens)."""
    def run(checkpoint, *extra: str) -> Result:
        capsys.readouterr()
        code = main(["generate", "--checkpoint", str(checkpoint), "--max-new-tokens", "8", "--temperature", "0",
                     "--num-blocks", "16", *extra])
        return Result(code, *capsys.readouterr())
    return run


def test_a_checkpoint_carries_its_tokenizer_and_names_it_relatively(trained):
    step = trained / "run" / "checkpoints" / "step_00000002"
    config = yaml.safe_load((step / "config.yaml").read_text())
    assert config["tokenizer"]["path"] == "tokenizer"
    assert (step / "tokenizer" / "tokenizer.json").read_bytes() == (trained / "tok" / "tokenizer.json").read_bytes()
    manifest = json.loads((step / "manifest.json").read_text())
    assert "tokenizer/tokenizer.json" in manifest["files"]   # hashed and checked like the weights


def test_generate_works_from_another_directory(trained, tmp_path, monkeypatch, generate):
    monkeypatch.chdir(tmp_path)   # neither tok/ nor run/ is here
    here = generate(trained / "run" / "checkpoints", "--prompt", "def ")
    assert here.returncode == 0, here.stderr
    monkeypatch.chdir(trained)
    there = generate("run/checkpoints", "--prompt", "def ")
    assert there.stdout == here.stdout and here.stdout.startswith("def ")


def test_meshtron_to_hf_exports_the_carried_tokenizer(trained, tmp_path, monkeypatch):
    """The carried tokenizer (named relative to the checkpoint) goes into the HF directory, from any directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "meshtron-to-hf", "--checkpoint", str(trained / "run" / "checkpoints"),
                 "--output", "hf"]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (trained / "tok" / "tokenizer.json").read_bytes()


def test_an_older_checkpoint_with_a_working_directory_path_and_the_tokenizer_override(trained, tmp_path,
                                                                                     monkeypatch, generate):
    """A checkpoint written before tokenizers were carried: config.yaml says tokenizer.path 'tok'."""
    import shutil

    from meshtron.checkpoint.layout import write_manifest

    old = trained / "old" / "step_00000002"
    shutil.copytree(trained / "run" / "checkpoints" / "step_00000002", old)
    shutil.rmtree(old / "tokenizer")
    config = yaml.safe_load((old / "config.yaml").read_text())
    config["tokenizer"]["path"] = "tok"
    (old / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    write_manifest(old, 2)
    monkeypatch.chdir(trained)
    reference = generate(old, "--prompt", "def ")
    assert reference.returncode == 0, reference.stderr   # from the directory it was trained in: as before
    monkeypatch.chdir(tmp_path)
    lost = generate(old, "--prompt", "def ")
    assert lost.returncode == 2 and lost.stderr.count("\n") == 1 and "tokenizer.path" in lost.stderr
    found = generate(old, "--prompt", "def ", "--tokenizer", str(trained / "tok"))
    assert found.returncode == 0, found.stderr
    assert found.stdout == reference.stdout
    missing = generate(old, "--tokenizer", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "--tokenizer" in missing.stderr and missing.stderr.count("\n") == 1


@pytest.mark.parametrize("prompt", [None, ""])
def test_an_empty_prompt_samples_from_the_start_of_a_document(trained, prompt, generate):
    result = generate(trained / "run" / "checkpoints", *([] if prompt is None else ["--prompt", prompt]))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "no --prompt: sampling from the start of a document"


def test_a_run_directory_as_checkpoint_names_its_checkpoints(trained, generate):
    result = generate(trained / "run", "--prompt", "x")
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert str(trained / "run" / "checkpoints") in result.stderr


def test_serve_on_a_port_in_use_is_one_line(trained, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "--checkpoint", str(trained / "run" / "checkpoints"), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and f"127.0.0.1:{port} is in use" in err and "--port" in err


def test_serve_start_up_line(trained):
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.models.accounting import count_parameters

    engine = LLMEngine.from_checkpoint(trained / "run" / "checkpoints", EngineConfig(num_blocks=12, block_size=8))
    line = serve_summary(engine, "127.0.0.1", 8000)
    cfg = yaml.safe_load((trained / "run" / "checkpoints" / "step_00000002" / "config.yaml").read_text())
    from meshtron.config.loader import config_from_dict

    params = count_parameters(config_from_dict(cfg).model, engine.tokenizer.vocab_size)
    assert line.startswith("serving checkpoints on http://127.0.0.1:8000: ") or line.startswith("serving run on")
    assert f"{params / 1e6:.2f}M parameters, float32 on cpu" in line
    assert "KV cache 12 blocks x 8 tokens (96 tokens)" in line
    assert f"max length {TINY['model.max_position_embeddings']}" in line
