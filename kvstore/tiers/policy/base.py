"""The policy interface and registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Hashable, Iterator

POLICIES: dict[str, Callable[[], "Policy"]] = {}


class Policy(ABC):
    """Orders the keys of one tier for eviction. Small, no I/O, no capacity or TTL logic.

    ``victims()`` yields keys best-evicted-first; the index skips pinned ones and stops as soon
    as it has freed enough, so implementations should yield lazily.
    """

    @abstractmethod
    def insert(self, key: Hashable) -> None: ...

    @abstractmethod
    def touch(self, key: Hashable, session: str | None = None) -> None: ...

    def touch_many(self, keys, session: str | None = None) -> None:
        """:meth:`touch` each key in order (the last ends most recent)."""
        for k in keys:
            self.touch(k, session)

    @abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def victims(self) -> Iterator[Hashable]: ...

    @abstractmethod
    def __len__(self) -> int: ...


def register_policy(name: str):
    def deco(cls):
        POLICIES[name] = cls
        return cls

    return deco


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
