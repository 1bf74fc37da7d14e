"""The house rules that a change can break without any other test noticing (issue 16)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("kvstore", "connectors", "bench", "csrc")
SUFFIXES = {".py", ".cpp", ".cu", ".cuh", ".hpp", ".h", ".sh"}
MAX_LINES = 400  # small files, one concept each


def test_no_source_file_outside_tests_is_over_400_lines():
    sizes = {}
    for top in SOURCES:
        for p in (ROOT / top).rglob("*"):
            if p.suffix in SUFFIXES and p.is_file() and "__pycache__" not in p.parts:
                sizes[p.relative_to(ROOT).as_posix()] = len(p.read_text(errors="replace").splitlines())
    assert len(sizes) > 50 and "kvstore/store.py" in sizes  # the walk saw the sources
    over = {f: n for f, n in sizes.items() if n > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines (split by concept): {over}"
