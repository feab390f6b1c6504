"""Step time and memory of a ~100M model with optimizer states offloaded to the CPU, against the device optimizer.

    python benchmarks/offload.py [--fractions 0,0.5,1] [--steps 3] [--warmup 1] [--section.field V ...]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.bench.offload import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
