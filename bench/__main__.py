"""``python -m bench NAME ...``: see bench.cli."""

import sys

from bench.cli import main

sys.exit(main())
