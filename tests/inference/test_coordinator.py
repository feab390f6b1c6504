"""The data-parallel coordinator with real processes on 127.0.0.1: a coordinator process, echo worker
processes and a client here. Round-robin placement, PAUSE/UNPAUSE/SUSPEND/RESUME/STOP barriers with
acknowledgements, a killed worker's requests re-sent (none lost), 1,000 requests through 2 workers."""

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


def test_round_robin_and_controls(cluster):
    cluster.add_worker("a")
    cluster.add_worker("b")
    client = CoordinatorClient(cluster.address)
    cluster.wait_workers(client, 2)
    responses = client.request_many([{"i": i} for i in range(10)])
    assert [r.result["echo"]["i"] for r in responses] == list(range(10))
    assert all(r.error is None and r.result["worker"] == r.worker for r in responses)
    # strictly alternating placement: requests 0, 2, 4.. on one worker, 1, 3, 5.. on the other
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
    assert counts == {"a": 500, "b": 500}
    client.close()


def test_unknown_signal_and_no_coordinator():
    with pytest.raises(CoordinatorError, match="within 1s"):
        CoordinatorClient("tcp://127.0.0.1:9", timeout_s=1.0)


def test_bad_signal_is_refused(cluster):
    client = CoordinatorClient(cluster.address)
    with pytest.raises(CoordinatorError, match="signal 'NAP'"):
        client.control("NAP")
    client.close()
