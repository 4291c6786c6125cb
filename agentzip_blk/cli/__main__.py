"""`python -m agentzip_blk.cli` (the tuner daemon is started this way)."""

import sys

from . import main

sys.exit(main())
