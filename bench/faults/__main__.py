"""``python -m kvstore.bench.faults``: the mode outside the CLI, with the flags of ``kvstore bench faults``."""

from kvstore.bench.faults import main

main()
