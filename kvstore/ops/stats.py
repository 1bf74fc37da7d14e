"""``kvstore stats``: read a store's Prometheus endpoint and print the readout
(:mod:`kvstore.offload.readout`: the hit rate, per tier, replay vs genuine, and why the rest
was computed). Whatever the server named (a request tag, a reason: label values) is printed
escaped (:mod:`kvstore.ops.printable`): ``--url`` may be any server, and a label any string."""

from __future__ import annotations

import urllib.request

from kvstore.offload import readout
from kvstore.offload.readout import parse
from kvstore.ops.printable import printable


def fetch(url: str, timeout: float = 5.0) -> dict:
    """The samples of ``url`` (a Prometheus text endpoint), parsed."""
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - a user-given local URL
        return parse(r.read().decode())


def render(s: dict) -> str:
    """The readout's text, every string in ``s`` (keys and values) made printable first."""
    return readout.render(_printable(s))


def _printable(v):
    if isinstance(v, dict):
        return {_printable(k): _printable(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_printable(x) for x in v]
    return printable(v) if isinstance(v, str) else v
