"""The commands written in README.md and docs/*.md: found, classified, and shrunk for the smoke tests.

A command is a line (continued with a trailing backslash) of a fenced block tagged `bash`, `sh`,
`shell` or `console`. Untagged or `text` blocks are synopses and output, never run. Every command
must be one of the kinds below, or the docs test fails naming it:

    meshtron ... / python -m meshtron ...   parsed by the real CLI parser; run in the slow test
    torchrun ... -m meshtron <verb> ...     parsed; a `train` or `distill` line is also planned for its world size
                                            (`meshtron plan`: degrees, divisibility, batch sizes)
    python benchmarks/<x>.py ...            the script exists; the slow test runs it with --help
    python -c CODE                          compiles; run in the slow test
    make <target>                           the target exists in the Makefile
    curl ...                                run in the slow test against the page's `meshtron serve`
    ls / cat / head / tail / wc / mkdir     run in the slow test (the files the page talks about exist)
    pip / git / source / cd / export ...    setup on the reader's machine; `pip install '.[x]'` extras exist

`<!-- docs-test: parse-only -->` on the line before a block keeps its commands out of the slow run
(they are still parsed). Sizes are shrunk by appending the flags of SHRINK that the verb accepts;
a page that adds a verb with its own size knobs adds them there.
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SETUP_PROGRAMS = {"source", "pip", "pip3", "git", "cd", "export", "nvidia-smi", "uv", "conda", "kill", "sudo",
                  "apt-get"}
INSPECT_PROGRAMS = {"ls", "cat", "head", "tail", "wc", "mkdir"}
MARKER = re.compile(r"<!--\s*docs-test:\s*([\w-]+)\s*-->")

# Appended (so they win) to every meshtron command whose parser has the flag: a run of seconds.
SHRINK = {
    "--train.train_iters": "2", "--train.eval_interval": "0", "--train.eval_iters": "1",
    "--train.micro_batch_size": "2", "--train.global_batch_size": "2", "--train.peak_flops": "1e11",
    "--model.num_layers": "1", "--model.hidden_size": "32",
    "--model.num_attention_heads": "4", "--model.num_query_groups": "2", "--model.ffn_hidden_size": "64",
    "--model.max_position_embeddings": "256", "--data.seq_length": "32",
    "--model.mamba_head_dim": "8", "--model.mamba_state_dim": "16", "--model.mamba_chunk_size": "16",
    "--logger.progress_bar": "off", "--checkpoint.save_interval": "0",
    "--max-new-tokens": "8", "--max-documents": "40", "--kv-cache-memory-mb": "16",
    "--rl.warmup_steps": "2", "--rl.warmup_batch_size": "4", "--rl.prompts_per_step": "2", "--rl.group_size": "2",
    "--rl.max_new_tokens": "4", "--rl.eval_problems": "4", "--rl.eval_samples": "0",
}
# Verbs that allocate nothing and run in seconds as written: shrinking would only change what they check.
NO_SHRINK_VERBS = {"plan", "config", "check-api", "data", "convert"}
# `meshtron bench NAME` hands its arguments to the benchmark's own parser (meshtron.bench.MODULE.build_parser);
# the slow run appends these (outputs go into the sandbox, not the repository).
BENCH_MODULES = {"train": "train_throughput", "mamba": "mamba", "offload": "offload"}
SHRINK_BENCH = {
    "train": ["--preset", "tiny", "--steps", "2", "--warmup", "1", "--repeats", "1",
              "--output", "runs/bench/train_throughput.json"],
    "mamba": ["--train-lengths", "64", "--decode-lengths", "32,64", "--tokens-per-step", "128", "--steps", "1",
              "--warmup", "0", "--decode-steps", "2", "--hidden-size", "32", "--sublayers", "4",
              "--attention-layers", "2", "--mamba-state", "8", "--chunk-size", "16", "--output", "runs/bench/mamba.json"],
}
# The dry run of a torchrun line needs a vocabulary size when the tokenizer files are not there yet.
PLAN_VOCAB = "4096"


@dataclass
class DocCommand:
    file: str              # relative to the repository root
    line: int              # 1-based line of the command's first line
    text: str
    argv: list[str]
    lang: str
    parse_only: bool = False
    kind: str = ""
    tail: list[str] = field(default_factory=list)   # the meshtron arguments (after `meshtron` / `-m meshtron`)
    world_size: int = 1

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class DocBlock:
    file: str
    line: int              # 1-based line of the first line inside the fence
    lang: str
    body: str
    parse_only: bool


def doc_files() -> list[Path]:
    """README.md, every page under docs/, then the READMEs of examples/ (new pages are picked up by themselves)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("README.md"))]


def blocks(path: Path) -> list[DocBlock]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(2), m.group(3).lower()
        marker = MARKER.search(lines[i - 1]) if i > 0 else None
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = "\n".join(line[len(m.group(1)):] for line in lines[i + 1:j])
        out.append(DocBlock(rel, i + 2, lang, body, bool(marker and marker.group(1) == "parse-only")))
        i = j + 1
    return out


def commands(path: Path) -> list[DocCommand]:
    """Every shell command of `path`, classified (kind, tail, world size)."""
    out = []
    for block in blocks(path):
        if block.lang not in SHELL_LANGS:
            continue
        pending, start = "", 0
        for k, raw in enumerate(block.body.splitlines()):
            text = raw.strip()
            if not pending:
                start = block.line + k
                if text.startswith("$ "):
                    text = text[2:]
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            text, pending = pending + text, ""
            argv = shlex.split(text, comments=True)
            if argv:
                cmd = DocCommand(block.file, start, text, argv, block.lang, block.parse_only)
                classify(cmd)
                out.append(cmd)
    return out


def classify(cmd: DocCommand) -> None:
    argv = cmd.argv
    prog = Path(argv[0]).name
    if prog == "meshtron":
        cmd.kind, cmd.tail = "meshtron", argv[1:]
    elif prog.startswith("python") and argv[1:3] == ["-m", "meshtron"]:
        cmd.kind, cmd.tail = "meshtron", argv[3:]
    elif prog.startswith("python") and argv[1:2] == ["-c"] and len(argv) == 3:
        cmd.kind, cmd.tail = "python-code", argv[2:]
    elif prog.startswith("python") and argv[1:3] == ["-m", "venv"]:
        cmd.kind = "setup"
    elif prog.startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
        cmd.kind, cmd.tail = "script", argv[1:]
    elif prog == "torchrun":
        cmd.kind = "torchrun"
        nproc, nnodes, i = 1, 1, 1
        while i < len(argv) and argv[i:i + 2] != ["-m", "meshtron"]:
            key, _, value = argv[i].partition("=")
            if key in ("--nproc-per-node", "--nproc_per_node", "--nnodes") and not value:
                i += 1
                value = argv[i]
            if key in ("--nproc-per-node", "--nproc_per_node"):
                nproc = int(value)
            elif key == "--nnodes":
                nnodes = int(value.split(":")[-1])
            i += 1
        cmd.tail, cmd.world_size = argv[i + 2:], nproc * nnodes
        if i >= len(argv):
            cmd.kind = "unknown"  # torchrun of something other than `-m meshtron`
    elif prog == "make":
        cmd.kind, cmd.tail = "make", argv[1:]
    elif prog == "curl":
        cmd.kind, cmd.tail = "curl", argv[1:]
    elif prog in INSPECT_PROGRAMS:
        cmd.kind, cmd.tail = "inspect", argv
    elif prog in SETUP_PROGRAMS:
        cmd.kind = "setup"
    else:
        cmd.kind = "unknown"


def verb_parser(parser: argparse.ArgumentParser, tail: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser that handles `tail`: `train` -> the train parser, `convert hf-to-meshtron` -> ..."""
    i = 0
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or i >= len(tail) or tail[i] not in subs[0].choices:
            return parser
        parser, i = subs[0].choices[tail[i]], i + 1


@functools.cache
def _cli_parser() -> argparse.ArgumentParser:
    from meshtron.cli import build_parser

    return build_parser()


def shrink(tail: list[str]) -> list[str]:
    """`tail` with the SHRINK flags its verb accepts appended (they override the page's values)."""
    if tail[0] == "bench" and tail[1:2] and tail[1] in SHRINK_BENCH:
        return [*tail, *SHRINK_BENCH[tail[1]]]
    if tail[0] in NO_SHRINK_VERBS:
        return list(tail)
    known = {opt for a in verb_parser(_cli_parser(), tail)._actions for opt in a.option_strings}
    extra = [token for flag, value in SHRINK.items() if flag in known for token in (flag, value)]
    return [*tail, *extra]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([\w.-]+):", text, re.M)}


def pyproject_extras() -> set[str]:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(data["project"].get("optional-dependencies", {}))


def pip_extras(argv: list[str]) -> list[str]:
    """Extras named by a `pip install` line: '.[dev,hf]' -> ['dev', 'hf'] (package names are ignored)."""
    out = []
    for arg in argv:
        m = re.match(r"^(?:\.|meshtron)\[([\w,\s-]+)\]$", arg)
        if m:
            out += [e.strip() for e in m.group(1).split(",")]
    return out


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative Markdown link (no scheme, not a pure #anchor)."""
    out = []
    in_fence = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        if in_fence:
            continue
        for m in re.finditer(r"\]\(([^)\s]+)\)", line):
            target = m.group(1)
            if not re.match(r"^[a-z]+:", target) and not target.startswith("#"):
                out.append((n, target.split("#")[0]))
    return out
