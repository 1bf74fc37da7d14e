"""What the rest of kvstore knows of a medium: its :class:`TierSpec`, one per medium, in
:mod:`kvstore.tiers.registry`.

The config reads a spec's sections (``tiers.<name>``, ``events.<name>``), the tier set opens the
tier with it, and the store, the metrics, the KV events, the connector and ``kvstore config``
loop over the registry: none of them names a medium. A medium is its folder under
:mod:`kvstore.tiers` (the tier, its ``spec.py``) and one line of the registry; a medium of
another package registers through the ``kvstore.tiers`` entry point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class TierSpec:
    name: str  # tiers.<name>, events.<name>, the tier label of the metrics, a match's tier names
    order: int  # the chain's order, nearest the engine first (built-ins: 100, 200, 300)
    config: type  # tiers.<name>'s dataclass (kvstore.configfields: field, section); ``enabled`` says it is on
    events: type  # events.<name>'s dataclass: ``medium`` (None: not announced) and ``locality``
    # (the tier set opening it, its section) -> the opened Tier, or None (nothing to open after all)
    open: Callable[[Any, Any], Any]
    # vLLM's CacheHitSource member its hits are counted under (vllm:prompt_tokens_cached_by_source)
    hit_source: str = "EXTERNAL_UNSPECIFIED"
    local: bool = True  # on this host, with an index of its own (a shared tier is not)
    namespaced: bool = False  # its blocks live under a namespace of the chain root and its codec
    # its section -> what this machine cannot give it (ConfigErrors, checked at start-up and by
    # ``kvstore config``; never by the config's own validation: the tuner builds configs for others)
    check: Callable[[Any], list] | None = None
    # (the tier set, its section) -> the tuner's stand-in: a tier of the same rules that holds no
    # bytes (kvstore.tiers.nobytes), or None (no room); None here: the tuner leaves the medium out
    stand_in: Callable[[Any, Any], Any] | None = None
