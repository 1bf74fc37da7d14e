"""Markdown tables, JSON and progress bars shared by every benchmark mode."""

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


def progress(total: int, description: str):
    """A rich progress bar (quiet when stdout is not a terminal)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                 TimeElapsedColumn(), transient=True)
    task = p.add_task(description, total=total)
    return p, task
