"""MoE sublayer throughput: against a dense MLP of the same active parameters, grouped vs looped experts,
and the per-token cost of routing and of each token dispatcher.

    python benchmarks/moe.py [--hidden-size 512] [--expert-ffn 1024] [--num-experts 8] [--topk 2]
                             [--batch-size 4] [--seq-length 512] [--device auto] [--dtype auto]
                             [--ep-sizes 2,4] [--output benchmarks/results/moe.json]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.bench.moe import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
