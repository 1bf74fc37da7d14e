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

    def touch_many(self, keys, session: str | None = None) -> None:
        order = self._order
        to_end = order.move_to_end
        for k in keys:  # (a hit's blocks: one call for the batch, a replay's most frequent step)
            if k in order:
                to_end(k)

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

    def touch_many(self, keys, session: str | None = None) -> None:
        pass
