import sys

from meshtron.cli import main

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

sys.exit(main())
