"""``python -m kvstore.bench.e2e``: the mode outside the CLI, with the flags of ``kvstore bench e2e``."""

from kvstore.bench.e2e import main

main()
