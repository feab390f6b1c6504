"""Processes for the coordinator tests (no torch): a coordinator, and echo workers that answer each
payload with itself and their name after an optional delay.

    python -m tests.inference.coordinator_procs coordinator HEARTBEAT_TIMEOUT_S
    python -m tests.inference.coordinator_procs worker ADDRESS NAME DELAY_S
"""

from __future__ import annotations

import sys
import time

from meshtron.inference.coordinator import Coordinator
from meshtron.inference.coordinator_worker import EngineWorker, FunctionHandler


def echo(name: str, delay_s: float):
    def answer(payload):
        if delay_s:
            time.sleep(delay_s)
        return {"echo": payload, "worker": name}
    return answer


if __name__ == "__main__":
    if sys.argv[1] == "coordinator":
        coordinator = Coordinator(heartbeat_timeout_s=float(sys.argv[2]))
        print(coordinator.address, flush=True)
        coordinator.run()
    else:
        address, name, delay = sys.argv[2], sys.argv[3], float(sys.argv[4])
        EngineWorker(address, FunctionHandler(echo(name, delay)), name, heartbeat_interval_s=0.1).run()
