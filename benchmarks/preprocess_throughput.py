"""Data pipeline throughput: `meshtron preprocess` tokens/s against the `tokenizers` library's own
encode_batch on the same stdlib corpus (same number of workers), and the GPTDataset index build
time for 100M synthetic tokens. Prints a table and writes JSON.

    python benchmarks/preprocess_throughput.py [--workers N] [--repeats N] [--tokenizer DIR] [--output FILE]
"""

import sys
from pathlib import Path

# Run from a checkout without installing the package: the repository root holds `meshtron/`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtron.data.bench_preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
