"""Serving past one process: throughput of a parallel layout against one process at equal total threads
(meshtron/bench/serve_parallel.py).

    python benchmarks/serve_parallel.py --mode pp [--pp 2] [--threads 1] [--micro-batches 0] [--num-requests 32]
                                        [--prompt-len 8 64] [--output-len 8 64] [--layers 8] [--hidden-size 256]
                                        [--repeats 3] [--output benchmarks/results/serve_parallel.json]
    python benchmarks/serve_parallel.py --mode dp [--dp 2] [--threads 1] [--num-requests 32] [same workload flags]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.bench.serve_parallel import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
