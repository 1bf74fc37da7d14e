"""LRU that protects blocks shared by several sessions (system prompt, tool schemas).

Two LRU segments: keys hit by fewer than ``shared_after`` distinct sessions are *probation*,
the rest are *protected*. Victims come from probation first, then from protected.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from kvstore.tiers.policy.base import Policy, register_policy


@register_policy("lru_shared")
class SharedLRUPolicy(Policy):
    def __init__(self, shared_after: int = 2, max_sessions_tracked: int = 8) -> None:
        self.shared_after = shared_after
        self.max_tracked = max_sessions_tracked
        self._probation: OrderedDict[Hashable, None] = OrderedDict()
        self._protected: OrderedDict[Hashable, None] = OrderedDict()
        self._sessions: dict[Hashable, set] = {}

    def insert(self, key: Hashable) -> None:
        self.remove(key)
        self._probation[key] = None

    def touch(self, key: Hashable, session: str | None = None) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        if key not in self._probation:
            return
        if session is not None:
            seen = self._sessions.setdefault(key, set())
            if len(seen) < self.max_tracked:
                seen.add(session)
            if len(seen) >= self.shared_after:
                del self._probation[key]
                self._sessions.pop(key, None)
                self._protected[key] = None
                return
        self._probation.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._probation.pop(key, None)
        self._protected.pop(key, None)
        self._sessions.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        yield from self._probation
        yield from self._protected

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)
