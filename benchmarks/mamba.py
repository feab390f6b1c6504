"""Hybrid Mamba vs pure attention of equal size: training tokens/s and peak memory by sequence length,
decode ms/token by context length (same as `meshtron bench mamba`).

    python benchmarks/mamba.py [--train-lengths 512,1024,2048,4096,8192] [--decode-lengths ...] [--help]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.bench.mamba import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
