"""``python -m kvstore.bench.agent``: the mode outside the CLI, with the flags of ``kvstore bench agent``."""

from kvstore.bench.agent import main

main()
