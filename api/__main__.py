"""``python -m api``: the ``troupe`` command without the console script installed."""

import sys

from troupe.api.cli import main

sys.exit(main())
