"""The data-parallel coordinator with real processes on 127.0.0.1: a coordinator process, echo worker
processes and a client here. Least-loaded placement (equal loads take turns), PAUSE/UNPAUSE/SUSPEND/RESUME/STOP barriers with
acknowledgements, a killed worker's requests re-sent (none lost), 1,000 requests through 2 workers; real engine workers (`python -m
meshtron.inference.coordinator_worker --checkpoint`) answering as the in-process engine does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtron.inference.coordinator import CoordinatorClient, CoordinatorError

ROOT = Path(__file__).resolve().parents[2]


def spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "tests.inference.coordinator_procs", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Cluster:
    def __init__(self, heartbeat_timeout_s: float = 1.0):
        self.procs: list[subprocess.Popen] = []
        coordinator = self.start("coordinator", str(heartbeat_timeout_s))
        self.address = coordinator.stdout.readline().strip()
        assert self.address.startswith("tcp://127.0.0.1:"), coordinator.stderr.read()
        self.workers: dict[str, subprocess.Popen] = {}

    def start(self, *args: str) -> subprocess.Popen:
        proc = spawn(*args)
        self.procs.append(proc)
        return proc

    def add_worker(self, name: str, delay_s: float = 0.0) -> None:
        self.workers[name] = self.start("worker", self.address, name, str(delay_s))

    def wait_workers(self, client: CoordinatorClient, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(client.stats()["workers"]) < n:
            assert time.monotonic() < deadline, "workers did not register"
            time.sleep(0.05)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


def test_least_loaded_placement_and_controls(cluster):
    cluster.add_worker("a")
    cluster.add_worker("b")
    client = CoordinatorClient(cluster.address)
    cluster.wait_workers(client, 2)
    client.control("PAUSE")  # nothing is answered while placing: each placement sees the loads before it
    ids = [client.submit({"i": i}) for i in range(10)]
    client.control("UNPAUSE")
    responses = client.wait(ids)
    assert [r.result["echo"]["i"] for r in responses] == list(range(10))
    assert all(r.error is None and r.result["worker"] == r.worker for r in responses)
    # unit costs, equal loads take turns: requests 0, 2, 4.. on one worker, 1, 3, 5.. on the other
    workers = [r.worker for r in responses]
    assert set(workers) == {"a", "b"} and all(workers[i] != workers[i + 1] for i in range(9))

    ack = client.control("PAUSE")
    assert ack["type"] == "PAUSE_ACK" and ack["num_workers"] == 2
    ids = [client.submit({"i": i}) for i in range(4)]
    time.sleep(0.5)  # paused workers queue requests but do not answer them
    assert not client.socket.poll(200)
    ack = client.control("UNPAUSE")
    assert ack["type"] == "UNPAUSE_ACK"
    assert [r.result["echo"]["i"] for r in client.wait(ids)] == [0, 1, 2, 3]
    assert client.control("SUSPEND")["type"] == "SUSPEND_ACK"
    assert client.control("RESUME")["type"] == "RESUME_ACK"

    ack = client.control("STOP")
    assert ack["type"] == "STOP_ACK" and ack["num_workers"] == 0  # both acknowledged and left
    for proc in cluster.workers.values():
        assert proc.wait(timeout=30) == 0
    client.close()


def test_killed_worker_requests_are_resent(cluster):
    cluster.add_worker("slow", delay_s=0.3)
    cluster.add_worker("other", delay_s=0.3)
    client = CoordinatorClient(cluster.address)
    cluster.wait_workers(client, 2)
    ids = [client.submit({"i": i}) for i in range(12)]
    time.sleep(0.5)  # each worker holds several requests in flight
    cluster.workers["slow"].send_signal(signal.SIGKILL)
    responses = client.wait(ids, timeout_s=60)
    assert [r.result["echo"]["i"] for r in responses] == list(range(12))
    assert all(r.error is None for r in responses)
    # the requests that were placed on the killed worker and not yet answered were answered by the other
    assert sum(r.worker == "other" for r in responses) > 6
    assert client.stats()["in_flight"] == 0
    client.close()


def test_lost_worker_without_replacement_fails_clearly(cluster):
    cluster.add_worker("only", delay_s=5.0)
    client = CoordinatorClient(cluster.address)
    cluster.wait_workers(client, 1)
    ids = [client.submit({"i": i}) for i in range(3)]
    time.sleep(0.3)
    cluster.workers["only"].send_signal(signal.SIGKILL)
    responses = client.wait(ids, timeout_s=30)
    assert all(r.result is None and "worker only was lost" in r.error for r in responses)
    client.close()


def test_thousand_requests_through_two_workers(cluster):
    cluster.add_worker("a")
    cluster.add_worker("b")
    client = CoordinatorClient(cluster.address)
    cluster.wait_workers(client, 2)
    responses = client.request_many([{"i": i, "text": "x" * (i % 17)} for i in range(1000)], timeout_s=120)
    assert [r.result["echo"]["i"] for r in responses] == list(range(1000))
    assert all(r.result["echo"]["text"] == "x" * (r.result["echo"]["i"] % 17) for r in responses)
    counts = {name: sum(r.worker == name for r in responses) for name in ("a", "b")}
    assert sum(counts.values()) == 1000 and min(counts.values()) >= 400  # two equal workers share the load
    client.close()


def test_unknown_signal_and_no_coordinator():
    with pytest.raises(CoordinatorError, match="within 1s"):
        CoordinatorClient("tcp://127.0.0.1:9", timeout_s=1.0)


def test_bad_signal_is_refused(cluster):
    client = CoordinatorClient(cluster.address)
    with pytest.raises(CoordinatorError, match="signal 'NAP'"):
        client.control("NAP")
    client.close()


@pytest.mark.slow
def test_real_engine_workers_from_a_checkpoint(tmp_path):
    """Two `python -m meshtron.inference.coordinator_worker --checkpoint ...` processes serving a tiny
    checkpoint: requests alternate between them and each answer equals the in-process engine's."""
    from meshtron.inference.config import EngineConfig
    from meshtron.inference.engine import LLMEngine
    from meshtron.inference.request import SamplingParams
    from tests.inference.helpers import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "tiny")
    cluster = Cluster(heartbeat_timeout_s=30.0)  # a busy machine may delay heartbeats during a step
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in ("e0", "e1"):
        proc = subprocess.Popen([sys.executable, "-m", "meshtron.inference.coordinator_worker", "--address",
                                 cluster.address, "--checkpoint", ckpt, "--name", name, "--num-blocks", "64"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        cluster.procs.append(proc)
        cluster.workers[name] = proc
    client = CoordinatorClient(cluster.address, timeout_s=300)
    try:
        cluster.wait_workers(client, 2, timeout_s=300)
        prompts = [[1, 2, 3], [40, 41, 42, 43], [7], [100, 90, 80, 70, 60], "hello", [5, 5, 5, 5, 5, 5]]
        params = [SamplingParams(max_tokens=6, temperature=0.0, return_log_probs=True),
                  SamplingParams(max_tokens=5, temperature=0.8, seed=11, return_log_probs=True)]
        payloads = [{"prompt": p, "sampling": {k: v for k, v in vars(params[i % 2]).items() if not k.startswith("_")}}
                    for i, p in enumerate(prompts)]
        client.control("PAUSE")  # placed before any is answered: equal loads take turns
        ids = [client.submit(p) for p in payloads]
        client.control("UNPAUSE")
        responses = client.wait(ids, timeout_s=300)
        assert all(r.error is None for r in responses), [r.error for r in responses]
        workers = [r.worker for r in responses]
        assert set(workers) == {"e0", "e1"} and all(workers[i] != workers[i + 1] for i in range(len(workers) - 1))
        local = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_blocks=64)).generate(
            prompts, [params[i % 2] for i in range(len(prompts))])
        for r, o in zip(responses, local):
            assert r.result["token_ids"] == list(o.token_ids) and r.result["text"] == o.text
            assert r.result["prompt_token_ids"] == list(o.prompt_token_ids)
            assert max(abs(a - b.log_prob) for a, b in zip(r.result["log_probs"], o.log_probs)) <= 1e-5
        assert client.control("STOP")["num_workers"] == 0
        for name in ("e0", "e1"):
            assert cluster.workers[name].wait(timeout=60) == 0
    finally:
        client.close()
        cluster.close()


def test_each_worker_gets_its_own_gpu():
    """DP workers of one host land on cuda:{local index}, not all on cuda:0."""
    from meshtron.inference.coordinator_worker import worker_device_index

    assert [worker_device_index(i, {}, 8) for i in range(4)] == [0, 1, 2, 3]
    assert worker_device_index(None, {"LOCAL_RANK": "5"}, 8) == 5  # a launcher's per-host index
    assert worker_device_index(None, {}, 8) == 0
    assert worker_device_index(3, {}, 0) is None  # no GPU: the engine runs on the CPU
    with pytest.raises(ValueError, match=r"^--local-index: 2 but this process sees 2 GPU\(s\)"):
        worker_device_index(2, {}, 2)


def test_worker_main_sets_the_cuda_device_before_building(monkeypatch):
    """`coordinator_worker --local-index 1` makes cuda:1 current before the engine is built."""
    import torch

    from meshtron.inference import coordinator_worker
    from meshtron.inference.engine import LLMEngine

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))

    def built(path, config):
        calls.append(("engine", path))
        raise SystemExit(0)  # stop before any model or socket is made

    monkeypatch.setattr(LLMEngine, "from_checkpoint", staticmethod(built))
    with pytest.raises(SystemExit):
        coordinator_worker.main(["--address", "tcp://127.0.0.1:1", "--checkpoint", "x", "--local-index", "1"])
    assert calls == [("set_device", 1), ("engine", "x")]
    calls.clear()
    with pytest.raises(SystemExit):
        coordinator_worker.main(["--address", "tcp://127.0.0.1:1", "--checkpoint", "x", "--device", "cpu"])
    assert calls == [("engine", "x")]
