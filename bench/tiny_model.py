"""The old name of bench/common/tiny_model.py, kept only for tests/test_tune.py (another change is
editing that file now): import ``kvstore.bench.common.tiny_model``; remove this once nothing
imports ``kvstore.bench.tiny_model``."""

from kvstore.bench.common.tiny_model import build_tiny_llama  # noqa: F401
