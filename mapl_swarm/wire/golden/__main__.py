"""``python -m mapl_swarm.wire.golden --out DIR | --check DIR``: regenerate or verify the vectors."""

import sys

from .vectors import main

sys.exit(main())
