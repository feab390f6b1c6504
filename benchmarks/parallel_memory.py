"""Per-rank memory and step time of each parallel layout of a ~50M model, against `meshtron plan`.

    python benchmarks/parallel_memory.py [--layouts single,fsdp4,...] [--steps N] [--warmup N] [--section.field V ...]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.bench.parallel_memory import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
