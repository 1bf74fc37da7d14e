"""Eviction policies, by name from a registry. A policy only orders keys; the tier index owns
capacity, TTL and pins (see :mod:`kvstore.tiers.index`)."""

from kvstore.tiers.policy.base import POLICIES, Policy, make_policy, register_policy
from kvstore.tiers.policy.lru import FIFOPolicy, LRUPolicy
from kvstore.tiers.policy.lru_shared import SharedLRUPolicy

__all__ = ["POLICIES", "Policy", "make_policy", "register_policy", "LRUPolicy", "FIFOPolicy",
           "SharedLRUPolicy"]
