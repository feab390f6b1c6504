"""Every command in README.md and docs/ is exercised, so the docs cannot rot.

Default suite (fast): each command parses with the real CLI parser, each torchrun training line is
planned for its world size (`meshtron plan`: the layout, divisibility and batch sizes are checked
without starting processes), configs named by the docs validate, Makefile targets, scripts, pip
extras and relative links exist, Python blocks compile.

Slow suite: each page runs top to bottom in its own copy of a sandbox prepared like `make run` (tiny sizes from
doc_commands.SHRINK); `meshtron serve` starts in the background on a free port for the page's curl
lines and Python blocks. See doc_commands.py for the rules.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from meshtron.testing.multiprocess import free_port
from tests.docs.doc_commands import (
    BENCH_MODULES,
    PLAN_VOCAB,
    ROOT,
    blocks,
    commands,
    doc_files,
    makefile_targets,
    pip_extras,
    relative_links,
    shrink,
)

FILES = doc_files()
IDS = [str(p.relative_to(ROOT)) for p in FILES]


def run_main(argv: list[str]) -> tuple[int, str]:
    """`meshtron <argv>` in this process: (exit status, stdout + stderr)."""
    from meshtron.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(argv)
    return rc, out.getvalue()


@functools.cache
def cli_parser(bench: str = ""):
    """The real parsers, built once (building one imports every verb's module); `bench`: that benchmark's own."""
    if bench:
        return importlib.import_module(f"meshtron.bench.{BENCH_MODULES[bench]}").build_parser()
    from meshtron.cli import build_parser

    return build_parser()


def parse(tail: list[str]) -> tuple[object, str]:
    """Parse a meshtron command line with the real parsers; (namespace or None after --help, error)."""
    if tail[0] == "bench" and tail[1:2] and tail[1] in BENCH_MODULES:
        parser, argv = cli_parser(bench=tail[1]), [a for a in tail[2:] if a != "--"]
    else:
        parser, argv = cli_parser(), tail
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return parser.parse_args(argv), ""
    except SystemExit as e:
        if e.code == 0 and ("--help" in argv or "-h" in argv):
            return None, ""
        return None, out.getvalue().strip() or f"exit status {e.code}"


def config_file(tail: list[str]) -> str | None:
    return tail[tail.index("--config") + 1] if "--config" in tail[:-1] else None


def check_layout(namespace, config: str | None, world_size: int) -> str:
    """What `meshtron plan` checks before it traces anything (and training at start-up): the degrees
    against the world size, the batch split, tp against heads and widths, the pipeline split."""
    import torch

    from meshtron.config.loader import load_config, overrides_from_args
    from meshtron.models.gpt import GPTModel
    from meshtron.parallel.dims import ParallelDims
    from meshtron.parallel.plan import num_microbatches, rank_chunks
    from meshtron.parallel.tensor_parallel import check_tp_divisibility

    try:
        cfg = load_config(ROOT / config if config else None, overrides_from_args(namespace), world_size=world_size)
        dims = ParallelDims.from_config(cfg.parallel, world_size)
        num_microbatches(cfg, dims)
        if dims.tp > 1:
            with torch.device("meta"):
                check_tp_divisibility(GPTModel(cfg.model, cfg.model.vocab_size or int(PLAN_VOCAB)), dims.tp)
        rank_chunks(cfg, dims)
    except ValueError as e:
        return str(e)
    return ""


def check_command(cmd) -> str:
    """'' when the command is fine for the fast checks, else why not."""
    if cmd.kind == "unknown":
        return "is not a command the docs test knows (see tests/docs/doc_commands.py)"
    if cmd.kind == "make":
        missing = [t for t in cmd.tail if not t.startswith("-") and t not in makefile_targets()]
        return f"Makefile has no target(s) {missing}" if missing else ""
    if cmd.kind == "script":
        return "" if (ROOT / cmd.tail[0]).is_file() else f"{cmd.tail[0]} does not exist"
    if cmd.kind == "setup":
        if cmd.argv[:2] in (["pip", "install"], ["pip3", "install"]):
            tomllib = pytest.importorskip("tomllib")
            extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
            missing = [e for e in pip_extras(cmd.argv) if e not in extras]
            return f"pyproject.toml has no extra(s) {missing}" if missing else ""
        return ""
    if cmd.kind in ("curl", "inspect"):
        return ""
    if cmd.kind == "python-code":
        try:
            compile(cmd.tail[0], cmd.where, "exec")
        except SyntaxError as e:
            return f"does not compile: {e.msg}"
        return ""
    namespace, error = parse(cmd.tail)
    if error:
        return f"does not parse: {error}"
    config = config_file(cmd.tail)
    if config is not None and not (ROOT / config).is_file():
        return ""  # written by an earlier command of the page: the slow test runs it
    verb = cmd.tail[0]
    if cmd.kind == "torchrun" and verb in ("train", "distill"):  # rl checks its own batch split (rl.*)
        why = check_layout(namespace, config, cmd.world_size)
        return f"is not a valid layout for {cmd.world_size} processes: {why}" if why else ""
    if verb == "train" and namespace is not None:
        from meshtron.config.loader import load_config, overrides_from_args

        world = getattr(namespace, "world_size", None) or 1   # a --dry-run checks the layout for --world-size
        try:
            load_config(ROOT / config if config else None, overrides_from_args(namespace), world_size=world)
        except ValueError as e:
            return f"config does not validate: {e}"
    return ""


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_doc_commands_parse_and_layouts_plan(path):
    problems = [f"{c.where}: `{c.text}` {why}" for c in commands(path) if (why := check_command(c))]
    for block in blocks(path):
        if block.lang in ("python", "py"):
            try:
                compile(block.body, f"{block.file}:{block.line}", "exec")
            except SyntaxError as e:
                problems.append(f"{block.file}:{block.line + (e.lineno or 1) - 1}: Python block does not compile: {e.msg}")
    for line, target in relative_links(path):
        if target and not (path.parent / target).exists():
            problems.append(f"{path.relative_to(ROOT)}:{line}: link to {target}, which does not exist")
    assert not problems, "\n".join(problems)


def test_the_rules_are_applied(tmp_path):
    """The extraction and shrinking themselves, on a made-up page."""
    page = tmp_path / "page.md"
    page.write_text("```bash\n# comment\n$ meshtron train --config configs/tiny.yaml \\\n    --parallel.tp 2  # two\n"
                    "torchrun --nproc-per-node=4 -m meshtron train --parallel.tp 2\nmake run\nfrobnicate now\n```\n"
                    "```\nmeshtron not a command\n```\n<!-- docs-test: parse-only -->\n```sh\npip install -e '.[hf,x]'\n```\n")
    found = commands(page)
    assert [(c.line, c.kind, c.world_size) for c in found] == [(3, "meshtron", 1), (5, "torchrun", 4), (6, "make", 1),
                                                               (7, "unknown", 1), (14, "setup", 1)]
    assert found[0].tail == ["train", "--config", "configs/tiny.yaml", "--parallel.tp", "2"]
    assert found[1].tail == ["train", "--parallel.tp", "2"] and not found[0].parse_only and found[4].parse_only
    assert pip_extras(found[4].argv) == ["hf", "x"]
    assert check_command(found[3]).startswith("is not a command")
    shrunk = shrink(["generate", "--checkpoint", "c", "--max-new-tokens", "200"])
    assert shrunk[-2:] == ["--kv-cache-memory-mb", "16"] and shrunk[shrunk.index("--max-new-tokens", 4) + 1] == "8"
    assert "--model.hidden_size" not in shrunk  # generate has no such flag
    assert "--model.hidden_size" in shrink(["train"])
    # the layout dry run refuses what training would refuse
    for layout, error in ((["--parallel.tp", "2", "--parallel.dp_shard", "2"], "global_batch_size"),
                          (["--parallel.tp", "3"], "must divide the world size 4"),
                          (["--parallel.tp", "4", "--model.num_attention_heads", "6", "--model.num_query_groups", "2"],
                           "num_attention_heads"),
                          (["--parallel.pp", "4", "--model.num_layers", "1"], "pp")):
        page.write_text(f"```bash\ntorchrun --nproc-per-node 4 -m meshtron train --config configs/tiny.yaml {' '.join(layout)}\n```\n")
        why = check_command(commands(page)[0])
        assert why.startswith("is not a valid layout for 4 processes") and error in why, (layout, why)
    page.write_text("```bash\ntorchrun --nproc-per-node 4 -m meshtron train --config configs/tiny.yaml --parallel.tp 2 "
                    "--parallel.dp_shard 2 --train.micro_batch_size 8\n```\n")
    assert check_command(commands(page)[0]) == ""


# ---- slow: run the pages ------------------------------------------------------------------------------

def sandbox_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}


def run_in(sandbox: Path, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=sandbox, env=sandbox_env(), capture_output=True, text=True, timeout=timeout)


def meshtron(sandbox: Path, tail: list[str]) -> subprocess.CompletedProcess:
    return run_in(sandbox, [sys.executable, "-m", "meshtron", *shrink(tail)])


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A working directory in the state `make run` leaves (tiny): runs/data and runs/tiny/checkpoints."""
    box = tmp_path_factory.mktemp("docs")
    for name in ("configs", "benchmarks", "examples"):
        (box / name).symlink_to(ROOT / name)
    steps = [["corpus", "stdlib", "--output", "runs/data/stdlib.jsonl"],
             ["tokenizer", "train", "--input", "runs/data/stdlib.jsonl", "--vocab-size", "4096",
              "--output", "runs/data/tokenizer"],
             ["preprocess", "--input", "runs/data/stdlib.jsonl", "--json-key", "text", "--tokenizer",
              "runs/data/tokenizer", "--output-prefix", "runs/data/stdlib", "--workers", "2", "--append-eod",
              "--no-progress"],
             ["train", "--config", "configs/tiny.yaml"]]
    for step in steps:
        done = meshtron(box, step)
        assert done.returncode == 0, f"preparing the sandbox: meshtron {' '.join(step)}\n{done.stderr[-3000:]}"
    return box


def page_items(path: Path) -> list[tuple[int, str, object]]:
    """The page's commands and Python blocks, in page order."""
    items = [(c.line, "command", c) for c in commands(path)]
    items += [(b.line, "python", b) for b in blocks(path) if b.lang in ("python", "py")]
    return sorted(items, key=lambda item: item[0])


def with_port(text: str, port: int) -> str:
    for host in ("127.0.0.1", "localhost", "0.0.0.0"):
        text = text.replace(f"{host}:8000", f"127.0.0.1:{port}")
    return text


def start_server(sandbox: Path, tail: list[str], port: int) -> subprocess.Popen:
    tail = list(tail)
    if "--port" in tail:
        tail[tail.index("--port") + 1] = str(port)
    else:
        tail += ["--port", str(port)]
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", *shrink(tail)], cwd=sandbox, env=sandbox_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"meshtron {' '.join(tail)} exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"meshtron {' '.join(tail)} was not healthy within 300 s")


def run_item(sandbox: Path, kind: str, item, port: int, servers: list) -> str:
    """Run one command or Python block; '' when it did what it should, else why not."""
    if kind == "python":
        if item.parse_only:
            return ""
        done = run_in(sandbox, [sys.executable, "-c", with_port(item.body, port)])
        return "" if done.returncode == 0 else f"Python block failed:\n{done.stderr[-3000:]}"
    cmd = item
    if cmd.parse_only or cmd.kind in ("setup", "make", "torchrun", "unknown"):
        return ""  # not runnable here; the fast test checked them
    if cmd.kind == "inspect":
        done = run_in(sandbox, cmd.tail)
        return "" if done.returncode == 0 else f"failed:\n{done.stderr[-3000:]}"
    if cmd.kind == "python-code":
        done = run_in(sandbox, [sys.executable, "-c", with_port(cmd.tail[0], port)])
        return "" if done.returncode == 0 else f"failed:\n{done.stderr[-3000:]}"
    if cmd.kind == "script":
        done = run_in(sandbox, [sys.executable, *cmd.tail[:1], "--help"])
        return "" if done.returncode == 0 else f"--help failed:\n{done.stderr[-3000:]}"
    if cmd.kind == "curl":
        if not servers:
            return "curl without a `meshtron serve` earlier on the page"
        done = run_in(sandbox, ["curl", "--silent", "--show-error", "--fail", *[with_port(a, port) for a in cmd.tail]],
                      timeout=300)
        return "" if done.returncode == 0 and done.stdout.strip() else f"failed:\n{done.stderr[-3000:]}{done.stdout[-500:]}"
    tail = list(cmd.tail)
    if tail[0] == "serve":
        servers.append(start_server(sandbox, tail, port))
        return ""
    if tail[0] == "check-api" and "--write-baseline" in tail:
        i = tail.index("--write-baseline")
        if i + 1 == len(tail) or tail[i + 1].startswith("-"):
            tail.insert(i + 1, str(sandbox / "api" / "baseline.json"))  # never the committed snapshot
    done = meshtron(sandbox, tail)
    allowed = (0, 1) if tail[0] == "check-api" else (0,)  # check-api reports breaks with 1
    if done.returncode in allowed:
        return ""
    return f"exit status {done.returncode}:\n{(done.stderr or done.stdout)[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_doc_commands_run(path, sandbox, tmp_path):
    """Each page runs in its own copy of the `make run` state: a page's runs do not meet another page's
    (a run directory that holds a run is refused, as a user re-running a command would see)."""
    sandbox = Path(shutil.copytree(sandbox, tmp_path / "box", symlinks=True))
    port, servers, problems = free_port(), [], []
    try:
        for _, kind, item in page_items(path):
            why = run_item(sandbox, kind, item, port, servers)
            if why:
                where = item.where if kind == "command" else f"{item.file}:{item.line}"
                text = item.text if kind == "command" else "python block"
                problems.append(f"{where}: `{text}` {why}")
    finally:
        for proc in servers:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert not problems, "\n".join(problems)


def test_every_page_is_linked_from_the_index():
    index = ROOT / "docs" / "index.md"
    linked = {(index.parent / target).resolve() for _, target in relative_links(index)}
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md"))
               if p != index and p.resolve() not in linked]
    assert not missing, f"add these pages to docs/index.md (and, for a user-facing one, README's list): {missing}"


def test_install_page_lists_every_extra():
    """docs/install.md's extras table names exactly the extras of pyproject.toml (a new extra must be documented)."""
    import re

    from tests.docs.doc_commands import pyproject_extras

    text = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w-]+)` \|", text, re.M))
    extras = pyproject_extras()
    assert listed == extras, (f"docs/install.md's extras table differs from pyproject.toml: missing {sorted(extras - listed)}, "
                              f"not an extra {sorted(listed - extras)}")


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    import re

    out, in_fence = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        m = None if in_fence else re.match(r"^#+\s+(.*)$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("path", FILES, ids=IDS)
def test_anchor_links_name_a_heading(path):
    """A link `page.md#anchor` (or `#anchor` on the same page) names a heading of that page."""
    import re

    problems, in_fence = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        if in_fence:
            continue
        for m in re.finditer(r"\]\(([^)\s#]*)#([^)\s]+)\)", line):
            target = (path.parent / m.group(1)) if m.group(1) else path
            if re.match(r"^[a-z]+:", m.group(1)) or target.suffix != ".md" or not target.exists():
                continue
            if m.group(2) not in heading_anchors(target):
                problems.append(f"{path.relative_to(ROOT)}:{n}: #{m.group(2)} is not a heading of {target.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)
