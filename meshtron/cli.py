"""The `meshtron` command: parse arguments, build a config, call one function.

    meshtron train --config C [--section.field value ...] [--save-wgrads DIR --save-dgrads DIR]
    meshtron distill --config C [--teacher.load DIR --distill.losses kl,hidden_cosine ...]
    meshtron grads compare RUN_A RUN_B [--step N]
    meshtron generate --checkpoint DIR --prompt "def " [--max-new-tokens --temperature --top-k --top-p --seed]
    meshtron serve --checkpoint DIR [--host 127.0.0.1 --port 8000 --drain-timeout 30 --api-key KEY
                   engine options, request limits]
    meshtron checkpoint upgrade PATH
    meshtron rl --config C [--section.field value ...]
    meshtron bench train [options]
    meshtron bench offload [options]
    meshtron bench hostile [options]
"""

from __future__ import annotations

import argparse
import errno
import sys
from typing import Optional

from meshtron.config.fields import ConfigError
from meshtron.config.loader import OneLineParser, add_config_arguments
from meshtron.config.reference import Section
from meshtron.inference.config import EngineConfig, add_engine_arguments
from meshtron.inference.dp_serving import add_dp_arguments, uses_replicas
from meshtron.inference.pipeline_args import add_pipeline_arguments
from meshtron.inference.server_config import add_server_arguments
from meshtron.training.dry_run import add_dry_run_arguments

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

# Documented in docs/config.md after the run sections: the flags of `meshtron serve` and `generate`.
ENGINE_SECTION = Section("engine", EngineConfig, "the inference engine behind `meshtron serve` and `meshtron generate`; "
                         "set on their command line", flag=lambda name: "--" + name.replace("_", "-"))


def cmd_train(args: argparse.Namespace) -> int:
    from meshtron.training import Trainer
    from meshtron.training.dry_run import load_for, run_dry_run
    from meshtron.training.run_dir import check_run_dir

    cfg = load_for(args, "train")
    if args.dry_run:
        return run_dry_run(cfg, "train", args.world_size)
    check_run_dir(cfg)
    Trainer(cfg).train()
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from meshtron.distill import DistillTrainer
    from meshtron.training.dry_run import load_for, run_dry_run
    from meshtron.training.run_dir import check_run_dir

    cfg = load_for(args, "distill")
    if args.dry_run:
        return run_dry_run(cfg, "distill", args.world_size)
    check_run_dir(cfg)
    DistillTrainer(cfg).train()
    return 0


def add_training_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """The config fields `command` reads as --section.field, plus the short gradient-capture flags."""
    add_config_arguments(parser, command=command)
    add_dry_run_arguments(parser)
    group = parser.add_argument_group("gradient capture (same as --grads.*)")
    group.add_argument("--save-wgrads", dest="grads.save_wgrads", default=argparse.SUPPRESS, metavar="DIR",
                       help="save the weight gradients of every linear, embedding, MoE expert and router layer under DIR")
    group.add_argument("--save-dgrads", dest="grads.save_dgrads", default=argparse.SUPPRESS, metavar="DIR",
                       help="save their input/output activation gradients under DIR")
    group.add_argument("--save-grads-interval", dest="grads.interval", default=argparse.SUPPRESS, metavar="N",
                       help="capture every N-th step (default 1)")


def cmd_generate(args: argparse.Namespace) -> int:
    from meshtron.inference.config import engine_config_from_args
    from meshtron.inference.engine import LLMEngine
    from meshtron.inference.request import InvalidRequestError, SamplingParams

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: {args.max_new_tokens} is not allowed; must be >= 1")
    engine = LLMEngine.from_checkpoint(args.checkpoint, engine_config_from_args(args, skip=("seed",)))
    prompt_ids = engine.tokenizer.encode(args.prompt)
    if not prompt_ids:
        # no prompt: sample a document from its start, the token that begins one in training (bos when the
        # tokenizer has one, else the end-of-document token that separates documents); it is not printed
        bos = getattr(engine.tokenizer, "bos_id", None)
        prompt_ids = [bos if bos is not None else engine.tokenizer.eod_id]
        print("no --prompt: sampling from the start of a document", file=sys.stderr)
    # like the reference loop: stop at the context length rather than refuse a long request
    max_tokens = max(1, min(args.max_new_tokens, engine.config.max_model_len - len(prompt_ids)))
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    try:
        out = engine.generate(prompt_ids, params)[0]
    except InvalidRequestError as e:
        raise ConfigError(f"--{e.param.replace('_', '-')}: {e.message}") from None
    print(args.prompt + out.text)
    return 0


def check_port_free(host: str, port: int) -> None:
    """Fail in one line before the checkpoint loads when the address cannot be listened on (a port in
    use), instead of uvicorn's log lines after it. uvicorn binds with SO_REUSEADDR too, so a port
    held only by closed connections in TIME_WAIT passes, as it does for uvicorn."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            why = "is in use by another process" if e.errno == errno.EADDRINUSE else f"cannot be listened on ({e.strerror})"
            raise ConfigError(f"--port: {host}:{port} {why}; stop that server or pass another --port") from None


def serve_summary(engine, host: str, port: int) -> str:
    """The start-up line of `meshtron serve`: model, size, dtype, KV cache and length limits, address."""
    c = engine.config
    model = engine.runner.model
    num_params = sum(p.numel() for p in model.parameters())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    size = f"{num_params / 1e9:.2f}B" if num_params >= 1e9 else f"{num_params / 1e6:.2f}M"
    return (f"serving {engine.model_name} on http://{host}:{port}: {size} parameters, {dtype} on "
            f"{engine.device.type}, KV cache {c.num_blocks} blocks x {c.block_size} tokens "
            f"({c.num_blocks * c.block_size} tokens), max length {c.max_model_len}, up to {c.max_num_seqs} sequences")


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from meshtron.checkpoint import resolve_checkpoint
    from meshtron.inference.config import engine_config_from_args
    from meshtron.inference.engine import LLMEngine
    from meshtron.inference.server import serve
    from meshtron.inference.server_auth import resolve_api_key
    from meshtron.inference.server_config import server_config_from_args
    from meshtron.parallel.distributed import world_from_env

    engine_cfg = engine_config_from_args(args)
    server_options = {"config": server_config_from_args(args), "api_key": resolve_api_key(args.api_key)}
    resolve_checkpoint(args.checkpoint)  # a wrong path fails here, in one line, before the server starts
    if uses_replicas(args):  # --dp, --coordinator-port: the HTTP front of replicas; --coordinator: one replica
        from meshtron.inference.dp_serving import serve_replicas

        if args.coordinator is None:
            check_port_free(args.host, args.port)
        return serve_replicas(args, engine_cfg, server_options)
    if args.pp > 1 or args.tp is not None:  # --pp/--tp: pipeline stages (of TP ranks) under torchrun
        from meshtron.inference.pipeline_args import parallel_degrees

        pp, tp = parallel_degrees(args.pp, args.tp, world_from_env()[2])
        if pp > 1:
            from meshtron.inference.pipeline_engine import serve_pipeline_parallel

            return serve_pipeline_parallel(args.checkpoint, engine_cfg, pp=pp, tp=tp, model_name=args.model_name,
                                           host=args.host, port=args.port, drain_timeout_s=args.drain_timeout,
                                           log_level=args.log_level, **server_options)
    if world_from_env()[2] > 1:  # under torchrun: tensor parallel over every rank, served from rank 0
        from meshtron.inference.tp_serving import serve_tensor_parallel

        return serve_tensor_parallel(args.checkpoint, engine_cfg, model_name=args.model_name, host=args.host,
                                     port=args.port, drain_timeout_s=args.drain_timeout, log_level=args.log_level,
                                     **server_options)
    check_port_free(args.host, args.port)

    def factory() -> LLMEngine:
        engine = LLMEngine.from_checkpoint(args.checkpoint, engine_cfg, model_name=args.model_name)
        logging.getLogger("meshtron.serve").info(serve_summary(engine, args.host, args.port))
        return engine

    return serve(factory, args.host, args.port, drain_timeout_s=args.drain_timeout, log_level=args.log_level,
                 **server_options)


def cmd_checkpoint_upgrade(args: argparse.Namespace) -> int:
    from meshtron.checkpoint import upgrade_checkpoint

    for step_dir, changed in upgrade_checkpoint(args.path):
        print(f"{step_dir}: {'upgraded' if changed else 'already current'}")
    return 0


def _bench_argv(args: argparse.Namespace) -> list[str]:
    """The benchmark's own arguments: what followed `meshtron bench NAME`, less the `--` main() put there."""
    return args.rest[1:] if args.rest[:1] == ["--"] else list(args.rest)


def cmd_bench_train(args: argparse.Namespace) -> int:
    from meshtron.bench.train_throughput import main as bench_main

    return bench_main(_bench_argv(args))


def cmd_bench_mamba(args: argparse.Namespace) -> int:
    from meshtron.bench.mamba import main as bench_main

    return bench_main(_bench_argv(args))


def cmd_bench_offload(args: argparse.Namespace) -> int:
    from meshtron.bench.offload import main as bench_main

    return bench_main(_bench_argv(args))


def cmd_bench_hostile(args: argparse.Namespace) -> int:
    from meshtron.bench.hostile import main as bench_main

    return bench_main(_bench_argv(args))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="meshtron", description="Train, serve and post-train LLMs on torch.distributed. "
                           "Flags are kebab-case or snake_case alike (--train.train-iters = --train.train_iters); a "
                           "boolean is --x or --no-x; `meshtron COMMAND --help` lists a command's flags.")
    parser.add_argument("--version", action="version", version=f"meshtron {meshtron_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND")

    train = sub.add_parser("train", help="train a model from a config", description="Train a model. Every config "
                           "field is a flag --section.field; values given here override the YAML file.")
    add_training_arguments(train, "train")
    train.set_defaults(func=cmd_train)

    distill = sub.add_parser("distill", help="distill a frozen teacher into a student",
                             description="Train the student of the config against the teacher of teacher.load "
                                         "with the losses of the distill section (docs/distillation.md).")
    add_training_arguments(distill, "distill")
    distill.set_defaults(func=cmd_distill)

    gen = sub.add_parser("generate", help="sample text from a checkpoint")
    gen.add_argument("--checkpoint", required=True, help="checkpoint directory (a step dir or its parent with 'latest')")
    gen.add_argument("--prompt", default="", help="text to continue")
    gen.add_argument("--max-new-tokens", "--max-tokens", type=int, default=200,
                     help="tokens to generate (default 200; rl.max_new_tokens in a config, max_tokens over HTTP)")
    gen.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 is greedy (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run (default auto)")
    add_engine_arguments(gen, skip=("device", "seed"))
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server for a checkpoint",
                         description="Serve /v1/completions, /v1/chat/completions, /v1/models and /health.")
    srv.add_argument("--checkpoint", required=True, help="checkpoint directory (a step dir or its parent with 'latest')")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--model-name", default=None, help="model id reported by /v1/models (default: checkpoint dir name)")
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds in-flight requests get to finish (default 30)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="uvicorn log level (default info)")
    srv.add_argument("--api-key", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                          "MESHTRON_API_KEY environment variable; neither: no key)")
    add_engine_arguments(srv)
    add_server_arguments(srv)
    add_pipeline_arguments(srv)
    add_dp_arguments(srv)
    srv.set_defaults(func=cmd_serve)

    ckpt = sub.add_parser("checkpoint", help="checkpoint tools")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", required=True, parser_class=OneLineParser)
    upgrade = ckpt_sub.add_parser(
        "upgrade", help="convert an older checkpoint (trainer_state.pt, no sha256) to the current format in place",
        description="Rewrite trainer_state.pt as trainer_state.json + trainer_state.safetensors and add sha256 "
                    "hashes to the manifest. Reading trainer_state.pt admits numpy's array reconstruction, which "
                    "loading refuses: run it only on checkpoints you trust (ones you wrote). docs/checkpoints.md")
    upgrade.add_argument("path", help="a step directory, or a save directory (every step directory in it)")
    upgrade.set_defaults(func=cmd_checkpoint_upgrade)

    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=OneLineParser)
    bt = bench_sub.add_parser("train", help="trainer tokens/s and MFU against a plain PyTorch loop", add_help=False)
    bt.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of benchmarks/train_throughput.py")
    bt.set_defaults(func=cmd_bench_train)
    bm = bench_sub.add_parser("mamba", help="hybrid Mamba vs attention: training tokens/s, memory, decode ms/token",
                              add_help=False)
    bm.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of benchmarks/mamba.py")
    bm.set_defaults(func=cmd_bench_mamba)
    bo = bench_sub.add_parser("offload", help="step time and memory with optimizer states offloaded to the CPU",
                              add_help=False)
    bo.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of benchmarks/offload.py")
    bo.set_defaults(func=cmd_bench_offload)
    bh = bench_sub.add_parser("hostile", help="good clients' completions and p50/p99 latency with and without a "
                              "hostile client", add_help=False)
    bh.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of benchmarks/hostile_load.py")
    bh.set_defaults(func=cmd_bench_hostile)

    from meshtron.api_check import register as register_check_api
    from meshtron.config.commands import register as register_config_commands
    from meshtron.data.commands import register as register_data_commands
    from meshtron.training.grad_compare import register as register_grads_commands

    register_data_commands(sub)
    register_grads_commands(sub)
    register_config_commands(sub, extra_sections=(ENGINE_SECTION,))
    register_check_api(sub)
    try:
        from meshtron.models.hf.commands import register as register_convert_commands
    except ImportError:
        pass
    else:
        from meshtron.models.megatron.commands import register as register_megatron_commands

        register_megatron_commands(register_convert_commands(sub))
    from meshtron.rl.commands import register as register_rl_command

    register_rl_command(sub)
    try:
        from meshtron.parallel.plan_command import register as register_plan_command
    except ImportError:
        pass
    else:
        register_plan_command(sub)
    completion = sub.add_parser("completion", help="print a shell completion script (extra 'completion')",
                                description="Print the completion script of `meshtron` for a shell, e.g. "
                                            "eval \"$(meshtron completion bash)\" in ~/.bashrc (docs/quickstart.md).")
    completion.add_argument("shell", choices=["bash", "zsh", "tcsh"], help="the shell to complete in")
    completion.set_defaults(func=lambda args: cmd_completion(args, parser))
    return parser


def meshtron_version() -> str:
    """The installed distribution's version (the package's own when it runs from a source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshtron")
    except PackageNotFoundError:
        import meshtron

        return meshtron.__version__


def cmd_completion(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        import shtab
    except ImportError:
        raise ConfigError("shell completion needs shtab: pip install 'meshtron[completion]'") from None
    print(shtab.complete(parser, shell=args.shell))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and argv[1:2] in (["train"], ["mamba"], ["offload"], ["hostile"]) and argv[2:3] != ["--"]:
        # argparse's REMAINDER refuses a first item that looks like an option: hand the rest over as is.
        argv = [*argv[:2], "--", *argv[2:]]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed in one line
        return int(e.code or 0)
    from meshtron.checkpoint import CheckpointError
    from meshtron.training import TrainingError
    from meshtron.training.interrupt import RunInterrupted

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RunInterrupted as e:  # SIGTERM/SIGINT: a checkpoint was saved; 143 or 130, as schedulers expect
        print(e, file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
