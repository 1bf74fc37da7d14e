"""The protocol of a benchmark mode (``kvstore bench MODE``, ``python -m kvstore.bench.MODE``).

A mode is a module whose docstring is its ``--help`` text, with ``add_args(parser)`` and
``run(args) -> dict`` (``kvstore/ops/cli.py`` finds it through the ``kvstore.bench`` entry
points, builds the parser and calls ``run``; a result with ``problems`` exits 1). What every mode
shares lives here: ``main`` (the same parser outside the CLI), the ``--json`` / ``--plots``
options and what they write (:func:`report`), or ``--json`` as a switch that prints the result as
JSON (:func:`show`), the YAML of a ``--config`` (:func:`read_yaml`) and the progress bar
(:class:`Progress`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Callable

from kvstore.bench.common.report import write_json
from kvstore.ops.errors import Parser


def parser(module: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The mode's parser: the one ``kvstore bench`` builds (prog, docstring, the mode's options)."""
    mod = sys.modules[module]
    name = mod.__spec__.name if getattr(mod, "__spec__", None) else module  # "bench.tiers", also under -m
    p = Parser(prog=prog or f"kvstore bench {name.rsplit('.', 1)[-1]}", description=mod.__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_args(p)
    return p


def main(module: str, argv: list[str] | None = None, prog: str | None = None) -> Any:
    """``python -m kvstore.bench.MODE``: parse ``argv`` as ``kvstore bench MODE`` would, then run."""
    return sys.modules[module].run(parser(module, prog).parse_args(argv))


def folder(path: str) -> str:
    """An argparse ``type`` for a folder option (``--dir``): made (0700, with its parents) when it
    is missing; a clear error, not a traceback halfway through the run, when it cannot be."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path}: not a folder")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{path}: cannot make this folder ({e.strerror})") from None
    return path


def output_args(p: argparse.ArgumentParser, *, plots: bool = True,
                json_help: str = "write results as JSON here") -> None:
    """``--json PATH`` and (unless ``plots=False``) ``--plots DIR``: what :func:`report` writes."""
    p.add_argument("--json", default=None, metavar="PATH", help=json_help)
    if plots:
        p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots into this folder")


def report(a: argparse.Namespace, data: dict, render: Callable[[dict], str],
           plot: Callable[[dict, str], Any] | None = None) -> dict:
    """Print the mode's tables, write ``--json``, draw ``--plots``; returns ``data``."""
    print(render(data))
    write_json(getattr(a, "json", None), data)
    if plot is not None and getattr(a, "plots", None):
        plot(data, a.plots)
    return data


def json_switch(p: argparse.ArgumentParser, help: str) -> None:
    """``--json`` as a switch, for the modes whose files are their own (``bench route``, ``bench
    soak``): the result printed as JSON instead of the tables (:func:`show`)."""
    p.add_argument("--json", action="store_true", help=help)


def show(a: argparse.Namespace, data: dict, render: Callable[[dict], str]) -> dict:
    """Print ``data`` as JSON under :func:`json_switch`'s ``--json``, else its tables; returns ``data``."""
    print(json.dumps(data, indent=1) if a.json else render(data), flush=True)
    return data


def read_yaml(path: str) -> dict:
    """A ``--config`` file: a YAML mapping (empty file: ``{}``)."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a YAML mapping")
    return data


class Progress:
    """A rich progress bar named after the mode (quiet when stdout is not a terminal):
    ``label(what)`` shows ``NAME: what``, ``advance(n)`` moves it."""

    def __init__(self, total: int, name: str):
        from rich.progress import BarColumn, Progress as Bar, TextColumn, TimeElapsedColumn

        self.name = name
        self.bar = Bar(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TimeElapsedColumn(), transient=True)
        self.task = self.bar.add_task(name, total=total)

    def __enter__(self) -> Progress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def label(self, what: str) -> None:
        self.bar.update(self.task, description=f"{self.name}: {what}")

    def advance(self, n: int = 1) -> None:
        self.bar.advance(self.task, n)


def stop_process(p, timeout: float) -> None:
    """SIGTERM ``p`` (a Popen) and wait up to ``timeout``; then SIGKILL it."""
    p.terminate()
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
