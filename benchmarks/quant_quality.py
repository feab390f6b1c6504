"""Quality of quantized weights against fp32: per-token log-prob deltas on held-out text, top-1 and
greedy agreement, per engine.quantize mode (docs/serving.md, "Quantized weights").

    python benchmarks/quant_quality.py --checkpoint runs/tiny/checkpoints [--modes int8-weight-only,int4-weight-only]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.bench.quant_quality import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
