"""Serving throughput and latency: meshtron's engine against transformers static batching and a naive loop;
with --mode decode, batch-1 decode against the memory-bandwidth limit (meshtron/bench/serve_decode.py).

    python benchmarks/serve.py [--num-requests 256] [--batch-size 32] [--prompt-len 8 128] [--output-len 8 128]
                               [--decode-attention auto gather compiled native] [--repeats N] [--pairs 3]
                               [--naive-requests N] [--skip engine static naive] [--output benchmarks/results/serve.json]
    python benchmarks/serve.py --mode decode [--repeats 5] [--decode-tokens 128] [--threads 2] [--skip fp32 int8 ...]
                               [--mtp-checkpoint runs/tiny-mtp/checkpoints] [--output benchmarks/results/serve_decode.json]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.bench.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
