"""Load with a hostile client: N good clients' completed count and p50/p99 latency with one client that
loops over the requests that once broke the server (issue 16), against none and against a
well-behaved client as busy.

    python benchmarks/hostile_load.py [--clients 8] [--requests 40] [--max-tokens 32] [--pairs 5]
                                      [--cases WORD ...] [--no-control] [--server-args FLAGS] [--url URL]
                                      [--output benchmarks/results/hostile.json]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.bench.hostile import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
