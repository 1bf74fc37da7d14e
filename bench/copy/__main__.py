"""``python -m kvstore.bench.copy``: the mode outside the CLI, with the flags of ``kvstore bench copy``."""

import sys

from kvstore.bench.copy import main

sys.exit(main())
