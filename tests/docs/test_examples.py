"""The configs of examples/: each is planned by `meshtron plan` at the world size its README gives and
its parameter count is checked against the published figure of the model it is shaped after (the
independent reference: the model cards and papers, not meshtron); `meshtron train --dry-run` accepts
each without allocating the model.

Published figures: Llama-3-8B 8.03B (Meta's model card); Qwen3-30B-A3B 30.5B total, 3.3B activated
(Qwen3 model card); DeepSeek-V3 671B total, 37B activated per token, the multi-token-prediction module
not included (DeepSeek-V3 technical report). Active parameters are the total less the routed experts
a token does not use: each routed expert tensor (experts, ...) counts k / experts of its size.

Planning traces one sublayer of each kind on fake tensors (seconds); the dry runs of the mixture-of-
experts models start a process each and are slow tests, the dense 8B model's dry run the fast representative.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.doc_commands import ROOT

EXAMPLES = ROOT / "examples"
# name: (world size of the README's torchrun line, published total, published active or None)
LARGE = {
    "llama3-8b": (64, 8.03e9, None),
    "qwen3-30b-a3b": (32, 30.5e9, 3.3e9),
    "deepseek-v3": (256, 671e9, 37e9),
}
TOLERANCE = 0.03   # "within a few %": published figures are rounded (8.03B, 30.5B, 3.3B, 671B, 37B)


def meshtron_main(argv: list[str]) -> tuple[int, str]:
    from meshtron.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


def plan_parameters(name: str, world_size: int, *flags: str) -> dict[str, tuple[int, ...]]:
    """`meshtron plan --parameters` of the example: {parameter name: full shape}, read from its table."""
    rc, out = meshtron_main(["plan", "--config", str(EXAMPLES / name / "config.yaml"), "--world-size",
                             str(world_size), "--parameters", *flags])
    assert rc == 0, out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("parameter "))
    shapes = {}
    for line in lines[start + 1:]:
        fields = line.split()
        if len(fields) >= 2 and re.fullmatch(r"\d+(x\d+)*", fields[1]):
            shapes[fields[0]] = tuple(int(n) for n in fields[1].split("x"))
    assert shapes, out
    return shapes


def counts(shapes: dict[str, tuple[int, ...]], topk: int | None) -> tuple[int, int]:
    """(total, active) of the main model (multi-token-prediction depths left out)."""
    total = active = 0
    for name, shape in shapes.items():
        if name.startswith("mtp."):
            continue
        n = math.prod(shape)
        total += n
        routed = re.search(r"\.experts\.[wb]_", name) is not None
        active += n * topk // shape[0] if routed and topk else n
    return total, active


def example_config(name: str):
    import yaml

    return yaml.safe_load((EXAMPLES / name / "config.yaml").read_text())


def check_counts(name: str) -> None:
    world, total_ref, active_ref = LARGE[name]
    model = example_config(name)["model"]
    total, active = counts(plan_parameters(name, world), model.get("moe_router_topk"))
    assert abs(total / total_ref - 1) < TOLERANCE, f"{name}: {total / 1e9:.3f}B parameters, published {total_ref / 1e9}B"
    if active_ref is not None:
        assert abs(active / active_ref - 1) < TOLERANCE, \
            f"{name}: {active / 1e9:.3f}B active parameters, published {active_ref / 1e9}B"


def test_every_example_has_a_config_and_a_readme_that_runs_it():
    dirs = sorted(p for p in EXAMPLES.iterdir() if p.is_dir())
    assert {p.name for p in dirs} >= {*LARGE, "tiny-cpu", "tiny-moe-cpu"}
    index = (EXAMPLES / "README.md").read_text()
    for d in dirs:
        readme = (d / "README.md").read_text()
        assert (d / "config.yaml").is_file(), d
        assert f"examples/{d.name}/config.yaml" in readme, f"{d.name}/README.md shows no command running its config"
        assert f"]({d.name})" in index, f"examples/README.md does not list {d.name}"


def test_llama3_8b_plans_at_its_published_size():
    check_counts("llama3-8b")


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_moe_examples_plan_at_their_published_sizes(name):
    check_counts(name)


def test_deepseek_v3_pipeline_layout_of_the_readme_plans():
    """The README's pipeline variant (no MTP, pp 8 with uneven first/last stages, ep 32) on 256 GPUs."""
    shapes = plan_parameters("deepseek-v3", 256, "--model.mtp_num_layers", "0", "--parallel.pp", "8",
                             "--parallel.ep", "32", "--parallel.pp_first_stage_sublayers", "16",
                             "--parallel.pp_last_stage_sublayers", "10")
    assert not any(name.startswith("mtp.") for name in shapes)
    assert abs(counts(shapes, 8)[0] / 671e9 - 1) < TOLERANCE


def closed_form_dense(m: dict, vocab: int) -> int:
    """Parameters of a pre-norm GQA + SwiGLU decoder with untied head, written out by hand."""
    d, heads, groups, ffn = m["hidden_size"], m["num_attention_heads"], m["num_query_groups"], m["ffn_hidden_size"]
    head_dim = m.get("kv_channels") or d // heads
    attention = d * heads * head_dim * 2 + 2 * d * groups * head_dim + d    # q, o, k, v, its norm
    mlp = 3 * d * ffn + d                                                   # gate, up, down, its norm
    return m["num_layers"] * (attention + mlp) + 2 * vocab * d + d          # embedding, head, final norm


def test_tiny_examples_plan_at_their_closed_form_sizes():
    m = example_config("tiny-cpu")["model"]
    vocab = 384   # the byte tokenizer's 256 bytes and special tokens, padded to a multiple of 128
    assert counts(plan_parameters("tiny-cpu", 1), None)[0] == closed_form_dense(m, vocab)
    m = example_config("tiny-moe-cpu")["model"]
    d, e, f, head_dim = m["hidden_size"], m["num_moe_experts"], m["moe_ffn_hidden_size"], m["kv_channels"]
    attention = 2 * d * m["num_attention_heads"] * head_dim + 2 * d * m["num_query_groups"] * head_dim + d + 2 * head_dim
    moe = e * d + 3 * e * d * f + d                                          # router, experts, norm
    total, active = counts(plan_parameters("tiny-moe-cpu", 2, "--parallel.ep", "2", "--train.micro_batch_size", "4"), m["moe_router_topk"])
    assert total == m["num_layers"] * (attention + moe) + 2 * vocab * d + d
    assert total - active == m["num_layers"] * 3 * (e - m["moe_router_topk"]) * d * f


def dry_run(name: str, world: int, tmp_path: Path) -> tuple[str, int]:
    """`meshtron train --dry-run` of the example with its placeholder paths replaced by existing ones, in a
    fresh process: (output, that process's peak resident memory in bytes)."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus{suffix}").touch()
    code = ("import resource, sys\nfrom meshtron.cli import main\nrc = main(sys.argv[1:])\n"
            "print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(rc)")
    argv = ["train", "--config", str(EXAMPLES / name / "config.yaml"), "--dry-run", "--world-size", str(world),
            "--train.run_dir", str(tmp_path / "run")]
    if example_config(name)["tokenizer"]["type"] != "byte":
        argv += ["--tokenizer.path", str(tokenizer), "--data.paths", str(tmp_path / "corpus")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rss = int(re.search(r"maxrss_kib (\d+)", done.stdout).group(1)) * 1024
    return done.stdout, rss


def test_llama3_8b_dry_run_accepts_it_without_allocating(tmp_path):
    out, rss = dry_run("llama3-8b", 64, tmp_path)
    assert "dry run: ok" in out and "world 64" in out, out
    # the fp32 model alone is 32 GB; a dry run builds it on the meta device only
    assert rss < 4 * 2**30, f"the dry run's process peaked at {rss / 2**30:.1f} GiB"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_moe_examples_dry_run_without_allocating(name, tmp_path):
    out, rss = dry_run(name, LARGE[name][0], tmp_path)
    assert "dry run: ok" in out, out
    assert rss < 4 * 2**30, f"the dry run's process peaked at {rss / 2**30:.1f} GiB"


@pytest.mark.parametrize("name", ["tiny-cpu", "tiny-moe-cpu"])
def test_tiny_examples_dry_run(name, tmp_path):
    out, _ = dry_run(name, 1, tmp_path)
    assert "dry run: ok" in out and "data: the embedded stdlib corpus" in out, out
