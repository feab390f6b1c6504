import sys

from meshtron.cli import main

sys.exit(main())
