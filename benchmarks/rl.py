"""GRPO throughput: rollout and training tokens/s, generation share; engine vs naive rollouts, packed vs
padded training rows (see meshtron/bench/rl.py).

    python benchmarks/rl.py [--config configs/grpo-countdown-tiny.yaml] [--steps 6] [--warmup-steps 60]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.bench.rl import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
