"""``python -m kvstore.bench.node``: the mode outside the CLI, with the flags of ``kvstore bench node``."""

from kvstore.bench.node import main

main()
