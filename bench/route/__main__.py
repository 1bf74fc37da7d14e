"""``python -m kvstore.bench.route``: the mode outside the CLI, with the flags of ``kvstore bench route``."""

from kvstore.bench.route import main

main()
