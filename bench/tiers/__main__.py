"""``python -m kvstore.bench.tiers``: the mode outside the CLI, with the flags of ``kvstore bench tiers``."""

from kvstore.bench.tiers import main

main()
