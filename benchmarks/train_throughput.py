"""Training throughput of meshtron's trainer against a plain PyTorch loop (same as `meshtron bench train`).

    python benchmarks/train_throughput.py [--preset tiny|gpt2-124m] [--steps N] [--repeats N] [--section.field V ...]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.bench.train_throughput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
