"""`meshtron` as torchrun runs it for tests/training/test_elastic.py, plus the test's one hook: with
MESHTRON_TEST_KILL=RANK:STEP:MARKER in the environment, global rank RANK creates MARKER and SIGKILLs
itself as it starts the forward of step STEP. An existing MARKER disarms the hook, so the restarted
ranks run through. The trainer knows nothing of it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def arm(spec: str) -> None:
    rank, step, marker = spec.split(":", 2)
    if os.environ.get("RANK") != rank or Path(marker).exists():
        return
    from meshtron.training import Trainer

    forward_loss = Trainer._forward_loss

    def dying(self, mb):
        if self.step + 1 == int(step):  # inside step STEP, after its token count (a collective) and before the model
            Path(marker).write_text(os.environ["RANK"])
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_loss(self, mb)

    Trainer._forward_loss = dying


if __name__ == "__main__":
    if os.environ.get("MESHTRON_TEST_KILL"):
        arm(os.environ["MESHTRON_TEST_KILL"])
    from meshtron.cli import main

    sys.exit(main())
