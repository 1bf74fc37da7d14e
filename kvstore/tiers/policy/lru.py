"""Least-recently-used and first-in-first-out."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from kvstore.tiers.policy.base import Policy, register_policy


@register_policy("lru")
class LRUPolicy(Policy):
    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable, session: str | None = None) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


@register_policy("fifo")
class FIFOPolicy(LRUPolicy):
    """Insertion order only: hits do not refresh."""

    def touch(self, key: Hashable, session: str | None = None) -> None:
        pass
