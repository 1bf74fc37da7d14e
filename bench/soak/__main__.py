"""``python -m kvstore.bench.soak``: the mode outside the CLI, with the flags of ``kvstore bench soak``;
exits 1 when the soak found a problem."""

from kvstore.bench.soak import main

raise SystemExit(1 if main().get("problems") else 0)
