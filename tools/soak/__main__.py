"""``python -m tools.soak``: the same as ``troupe soak``."""

import sys

from troupe.tools.soak.run import main

sys.exit(main())
