"""Data-parallel serving: several engine replicas behind one HTTP endpoint, through the coordinator.

    meshtron serve --checkpoint C --dp 2                      # 2 replica processes + the HTTP front
    meshtron serve --checkpoint C --dp 0 --coordinator-port 5555   # a front; replicas register later:
    meshtron serve --checkpoint C --coordinator tcp://HOST:5555     # one replica (under torchrun: TP, or PP
                                                                    # with --pp; any engine the worker can step)

The front process runs the HTTP server, the coordinator (a thread) and `dp_front.ReplicaFront`; with
`--dp N` it also starts N replica processes (`meshtron serve --coordinator`, each with its share of
the CPU threads: the front's torch threads // N unless --replica-threads says) and waits for them to
register before it reports ready. A replica that dies has its requests re-sent to the others; when
every replica it started has exited the server stops (exit 1). On SIGTERM the front drains as the
one-engine server does, then stops its replicas (STOP) and waits for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from meshtron.config.fields import ConfigError
from meshtron.inference.config import EngineConfig

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

logger = logging.getLogger("meshtron.server")

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


def add_dp_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data-parallel replicas (docs/serving.md#data-parallel-serving)")
    group.add_argument("--dp", type=int, default=1, metavar="N",
                       help="serve through N engine replicas, each its own process, behind this server's "
                            "coordinator (default 1: one engine in this process; 0: only replicas that register "
                            "themselves, with --coordinator-port)")
    group.add_argument("--replica-threads", type=int, default=None, metavar="T",
                       help="CPU threads of each replica (default: this process's torch threads divided by --dp)")
    group.add_argument("--coordinator-host", default="127.0.0.1", metavar="HOST",
                       help="address the coordinator binds (default 127.0.0.1; 0.0.0.0 lets other hosts' "
                            "replicas register)")
    group.add_argument("--coordinator-port", type=int, default=None, metavar="PORT",
                       help="port the coordinator binds (default: a free one, logged); replicas started "
                            "elsewhere register there")
    group.add_argument("--coordinator", default=None, metavar="ADDR",
                       help="run one engine replica (no HTTP) registered with the coordinator at ADDR, e.g. "
                            "tcp://10.0.0.1:5555; under torchrun a tensor-parallel one, with --pp a pipeline")
    group.add_argument("--replica-name", default=None, metavar="NAME",
                       help="with --coordinator: this replica's name in /metrics (default replica-HOST-PID)")
    group.add_argument("--affinity-margin", type=float, default=512, metavar="TOKENS",
                       help="a replica that served a prompt's first blocks gets it while its outstanding tokens "
                            "are within this many of the least loaded replica's (default 512)")
    group.add_argument("--heartbeat-timeout", type=float, default=30.0, metavar="S",
                       help="seconds of silence after which a replica counts as dead and its requests are "
                            "re-sent (default 30)")
    # set by the front on the replicas it starts: exit when it is gone
    group.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)


def uses_replicas(args: argparse.Namespace) -> bool:
    return args.coordinator is not None or args.dp != 1 or args.coordinator_port is not None


def check_dp_arguments(args: argparse.Namespace) -> None:
    if args.dp < 0:
        raise ConfigError(f"--dp: {args.dp} is not allowed; give the number of replicas (>= 0)")
    if args.dp == 0 and args.coordinator is None and args.coordinator_port is None:
        raise ConfigError("--dp: 0 starts no replica; give --coordinator-port so replicas can register, or --dp N")
    if args.coordinator is None and (args.pp > 1 or args.tp is not None):
        raise ConfigError("--pp/--tp: the front of data-parallel replicas runs no model; start pipeline- or "
                          "tensor-parallel replicas under torchrun with --coordinator ADDR (docs/serving.md)")
    if args.replica_threads is not None and args.replica_threads < 1:
        raise ConfigError(f"--replica-threads: {args.replica_threads} is not allowed; must be >= 1")
    if args.affinity_margin < 0:
        raise ConfigError(f"--affinity-margin: {args.affinity_margin} is not allowed; must be >= 0 tokens")
    if args.heartbeat_timeout <= 0:
        raise ConfigError(f"--heartbeat-timeout: {args.heartbeat_timeout} is not allowed; must be > 0 seconds")


def serve_replicas(args: argparse.Namespace, engine_cfg: EngineConfig, server_options: dict) -> int:
    """`meshtron serve` with replicas: one replica (--coordinator) or the front (--dp, --coordinator-port)."""
    check_dp_arguments(args)
    if args.coordinator is not None:
        return run_replica(args, engine_cfg)
    return serve_front(args, engine_cfg, server_options)


# ---- one replica ------------------------------------------------------------------------------------

def run_replica(args: argparse.Namespace, engine_cfg: EngineConfig) -> int:
    """Register an engine with the coordinator and serve until STOP: under torchrun a tensor-parallel
    one, or with --pp a pipeline of --pp stages (of --tp ranks each)."""
    import torch

    from meshtron.inference.coordinator_worker import EngineHandler, EngineWorker
    from meshtron.inference.engine import LLMEngine
    from meshtron.parallel.distributed import world_from_env

    if args.replica_threads is not None:
        torch.set_num_threads(args.replica_threads)
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    name = args.replica_name or f"replica-{socket.gethostname()}-{os.getpid()}"

    def work(factory) -> int:
        EngineWorker(args.coordinator, EngineHandler(factory()), name).run()
        return 0

    if args.pp > 1:
        from meshtron.inference.pipeline_engine import run_pipeline_parallel

        return run_pipeline_parallel(args.checkpoint, engine_cfg, work, pp=args.pp, tp=args.tp,
                                     model_name=args.model_name)
    if world_from_env()[2] > 1:
        from meshtron.inference.tp_serving import run_tensor_parallel

        return run_tensor_parallel(args.checkpoint, engine_cfg, work, model_name=args.model_name)
    return work(lambda: LLMEngine.from_checkpoint(args.checkpoint, engine_cfg, model_name=args.model_name))


def _exit_with_parent(parent_pid: int) -> None:
    """A replica the front started ends with the front, even one killed with SIGKILL."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="meshtron-parent-watch", daemon=True).start()


# ---- the front --------------------------------------------------------------------------------------

def engine_flags(cfg: EngineConfig) -> list[str]:
    """`cfg` as the engine flags of `meshtron serve` (the fields that differ from the defaults)."""
    flags = []
    for f in dataclasses.fields(EngineConfig):
        value, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if value == f.default or value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            flags += [flag, ",".join(str(v) for v in value)]
        else:
            flags += [flag, str(value)]
    return flags


class LocalReplicas:
    """The replica processes the front started: `meshtron serve --coordinator ADDR` each."""

    def __init__(self, args: argparse.Namespace, engine_cfg: EngineConfig, address: str):
        import torch

        threads = args.replica_threads or max(1, torch.get_num_threads() // args.dp)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.procs: list[subprocess.Popen] = []
        for i in range(args.dp):
            command = [sys.executable, "-m", "meshtron", "serve", "--checkpoint", args.checkpoint,
                       "--coordinator", address, "--replica-name", f"replica-{i}", "--replica-threads", str(threads),
                       "--parent-pid", str(os.getpid()), *engine_flags(engine_cfg)]
            if args.model_name is not None:
                command += ["--model-name", args.model_name]
            # a session of its own: a terminal's Ctrl-C reaches the front, which drains before stopping them
            self.procs.append(subprocess.Popen(command, env=env, start_new_session=True))
        self.stopping = False
        self._reported: set[int] = set()
        logger.info("started %d engine replicas (%d CPU threads each), pids %s", args.dp, threads,
                    [p.pid for p in self.procs])

    def check(self) -> Optional[str]:
        """Log each replica that exited; -> why the server cannot go on once all of them have."""
        codes = [p.poll() for p in self.procs]
        for i, code in enumerate(codes):
            if code is not None and i not in self._reported and not self.stopping:
                self._reported.add(i)
                logger.error("engine replica-%d (pid %d) exited with code %d; its requests go to the others",
                             i, self.procs[i].pid, code)
        if self.procs and all(c is not None for c in codes) and not self.stopping:
            return f"every engine replica exited (exit codes {codes}); their errors are logged above"
        return None

    def stop(self, address: str) -> None:
        """STOP through the coordinator (each replica acknowledges and exits), then wait; kill stragglers."""
        from meshtron.inference.coordinator import CoordinatorClient, CoordinatorError

        self.stopping = True
        if any(p.poll() is None for p in self.procs):
            try:
                client = CoordinatorClient(address, timeout_s=STOP_TIMEOUT_S)
                client.control("STOP")
                client.close()
            except CoordinatorError as e:
                logger.warning("stopping the replicas: %s", e)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def serve_front(args: argparse.Namespace, engine_cfg: EngineConfig, server_options: dict) -> int:
    from meshtron.inference.coordinator import Coordinator
    from meshtron.inference.dp_front import ReplicaFront
    from meshtron.inference.loading import load_tokenizer
    from meshtron.inference.server import configure_logging, serve

    configure_logging(args.log_level)
    tokenizer = load_tokenizer(args.checkpoint, engine_cfg.tokenizer)  # the replicas get --tokenizer too
    coordinator = Coordinator(args.coordinator_host, args.coordinator_port, args.heartbeat_timeout,
                              args.affinity_margin).start()
    logger.info("coordinator at %s: replicas register with `meshtron serve --checkpoint ... --coordinator %s`",
                coordinator.address, coordinator.address)
    replicas = LocalReplicas(args, engine_cfg, coordinator.address) if args.dp > 0 else None

    def factory() -> ReplicaFront:
        front = ReplicaFront(coordinator.address, tokenizer, model_name=args.model_name, seed=engine_cfg.seed)
        front.check = replicas.check if replicas is not None else None
        front.start_background_loop()
        front.wait_for_replicas(max(1, args.dp), STARTUP_TIMEOUT_S)
        return front

    try:
        return serve(factory, args.host, args.port, drain_timeout_s=args.drain_timeout, log_level=args.log_level,
                     **server_options)
    finally:
        if replicas is not None:
            replicas.stop(coordinator.address)
        coordinator.close()
