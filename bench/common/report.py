"""Markdown tables, JSON files and PNG plots shared by every benchmark mode (the mode protocol:
bench/common/harness.py)."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence


def markdown_table(rows: Sequence[dict], columns: Sequence[str], headers: Sequence[str] | None = None) -> str:
    headers = list(headers or columns)

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


class Figures:
    """PNG plots into ``folder`` (matplotlib without a display): draw with ``plt``, write each
    figure with ``save(fig, name)``; ``paths`` lists what was written."""

    def __init__(self, folder: str):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(folder, exist_ok=True)
        self.plt, self.folder, self.paths = plt, folder, []

    def save(self, fig, name: str, layout: bool = True, dpi: int = 110) -> str:
        """``layout=False``: the caller laid the figure out (e.g. room left for a legend below)."""
        if layout:
            fig.tight_layout()
        path = os.path.join(self.folder, name)
        fig.savefig(path, dpi=dpi)
        self.plt.close(fig)
        self.paths.append(path)
        return path


def write_outputs(folder: str, name: str, data: dict, markdown: str) -> None:
    """``folder/NAME.json`` (``data``, indented) and ``folder/NAME.md``, the folder made: the pair a
    device run leaves for a person (bench/copy/gpu_bench.py, gpu_native.py, gpu_tax.py)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        f.write(json.dumps(data, indent=1))
    with open(os.path.join(folder, f"{name}.md"), "w") as f:
        f.write(markdown)
