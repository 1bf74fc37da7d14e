"""Eviction policies, by name from a registry. A policy only orders keys; the tier index owns
capacity, TTL and pins (see :mod:`kvstore.index`)."""

from kvstore.policy.base import POLICIES, Policy, make_policy, register_policy
from kvstore.policy.lru import FIFOPolicy, LRUPolicy
from kvstore.policy.lru_shared import SharedLRUPolicy

__all__ = ["POLICIES", "Policy", "make_policy", "register_policy", "LRUPolicy", "FIFOPolicy",
           "SharedLRUPolicy"]
