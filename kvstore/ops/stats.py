"""``kvstore stats``: read a store's Prometheus endpoint and print the readout
(:mod:`kvstore.offload.readout`: the hit rate, per tier, replay vs genuine, and why the rest
was computed)."""

from __future__ import annotations

import urllib.request

from kvstore.offload.readout import parse, render, summarize  # noqa: F401 (what the command prints)


def fetch(url: str, timeout: float = 5.0) -> dict:
    """The samples of ``url`` (a Prometheus text endpoint), parsed."""
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - a user-given local URL
        return parse(r.read().decode())
