"""The store: one public class over a chain of tiers (see :mod:`kvstore.store.store`)."""

from kvstore.store.handles import LoadHandle, PrefixMatch, StoreHandle
from kvstore.store.store import KVStore

__all__ = ["KVStore", "LoadHandle", "PrefixMatch", "StoreHandle"]
