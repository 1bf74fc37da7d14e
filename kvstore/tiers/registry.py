"""Every medium kvstore can put blocks in, in chain order: the one list the config, the tier set,
the store, the metrics, the KV events, the connector and ``kvstore config`` read.

A medium is registered once: a line of ``BUILT_IN`` for kvstore's own (each ``tiers/<medium>/
spec.py``), or, for another package's, an entry point in the ``kvstore.tiers`` group naming its
:class:`~kvstore.tiers.spec.TierSpec`::

    [project.entry-points."kvstore.tiers"]
    objstore = "mypkg.objstore:SPEC"

An entry point that does not load, or whose name or order another medium has, is logged and left
out (a broken plug-in costs its own medium, never the store's start).
"""

from __future__ import annotations

import importlib
import logging
import re
from importlib.metadata import entry_points

from kvstore.tiers.spec import TierSpec

log = logging.getLogger(__name__)

BUILT_IN = ("kvstore.tiers.dram.spec:SPEC", "kvstore.tiers.nvme.spec:SPEC", "kvstore.tiers.redis.spec:SPEC",
            "kvstore.tiers.sharedfs.spec:SPEC")
GROUP = "kvstore.tiers"
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
# section names a medium cannot take: they would shadow the config's own keys
_RESERVED = {"io", "metrics", "mode", "node", "events", "tiers", "trace_path", "trace_tokens", "max_hint_ttl_s"}


def _load(ref: str) -> TierSpec:
    mod, _, attr = ref.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _plugins() -> list[TierSpec]:
    out = []
    for ep in entry_points(group=GROUP):
        try:
            s = ep.load()
            if not isinstance(s, TierSpec):
                raise TypeError(f"{ep.value} is a {type(s).__name__}, not a TierSpec")
        except Exception as e:  # noqa: BLE001 - a broken plug-in is left out, said once
            log.error("kvstore: the tier plug-in %r (%s) is left out: %s", ep.name, ep.value, e)
            continue
        out.append(s)
    return out


def _build(specs: list[TierSpec]) -> tuple[TierSpec, ...]:
    kept: list[TierSpec] = []
    for s in specs:
        clash = next((k for k in kept if k.name == s.name or k.order == s.order), None)
        if not _NAME.fullmatch(s.name) or s.name in _RESERVED or clash is not None:
            why = f"its order {s.order} is {clash.name}'s" if clash is not None and clash.name != s.name else \
                "its name is taken" if clash is not None or s.name in _RESERVED else \
                "a name is 1 to 32 lower-case letters, digits or '_'"
            log.error("kvstore: the medium %r is left out: %s", s.name, why)
            continue
        kept.append(s)
    return tuple(sorted(kept, key=lambda s: s.order))


SPECS: tuple[TierSpec, ...] = _build([_load(r) for r in BUILT_IN] + _plugins())
NAMES: tuple[str, ...] = tuple(s.name for s in SPECS)


def spec(name: str) -> TierSpec | None:
    return next((s for s in SPECS if s.name == name), None)


_RANK = {n: i for i, n in enumerate(NAMES)}


def rank(name: str) -> int:
    """A tier's place in the chain, nearest the engine first (an unknown name: last). One dict
    lookup: the planner ranks every block of a hybrid model's hit on the scheduler thread."""
    return _RANK.get(name, len(NAMES))


def top() -> str:
    """The medium nearest the engine: the one whose slots the engine's copies reach."""
    return NAMES[0]
