"""A reference KV-aware router over vLLM's KV-event streams (issue 32), small enough to copy.

Each engine publishes its events (``--kv-events-config`` with a ZMQ publisher); kvstore adds its
tiers to the same stream (``medium`` CPU for DRAM, STORAGE for NVMe). :class:`PrefixIndex` keeps,
like llm-d's kv-cache manager, which engine holds which block on which medium, keyed by the
block's tokens and its parent (so it needs no engine's hash function): a ``BlockStored`` whose
parent it never saw cannot be placed and is skipped. :class:`Router` picks an engine per request:

* ``round_robin``: in turn;
* ``session``: a session always goes to the same engine (a hash of its id);
* ``prefix``: llm-d's default profile: 3 x a prefix score plus 2 x a queue score, the highest
  wins. The prefix score is the share of the prompt's blocks an engine holds from its start,
  each block weighted by the best medium it holds it on (llm-d's weights: GPU 1.0, CPU 0.8,
  STORAGE 0.4); the queue score is 1 for the least-loaded engine and 0 for the most loaded
  (requests in flight). So a whole prefix in HBM beats any load, and a loaded engine holding
  half of it loses to an idle one holding none; ties go to the engine routed to least.

    router = Router(n_engines, "prefix", block_size=32)
    router.apply(engine, batch.events)        # each decoded KVEventBatch of each engine
    e = router.pick(session_id, prompt_token_ids)
    router.done(e)                            # the request finished (the engine's load)
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Iterable, Sequence

import numpy as np
import xxhash

WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.4}  # llm-d's tier weights; an unknown medium scores 0
PREFIX_WEIGHT, QUEUE_WEIGHT = 3.0, 2.0  # llm-d's default scheduler profile (prefix cache, queue depth)
POLICIES = ("round_robin", "session", "prefix")
ROOT = b"\0" * 16


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A block's name in the index: its tokens and its parent's name (the engines' hashes differ)."""
    return xxhash.xxh3_128_digest(parent + np.asarray(tokens, dtype="<i4").tobytes())


class PrefixIndex:
    """block key -> engine -> medium -> how many of that engine's events say it is there."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.names: dict[tuple[int, object], bytes] = {}  # (engine, its block hash) -> block key
        self.where: dict[bytes, dict[int, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
        self.skipped = 0  # stored events whose parent was never seen

    def apply(self, engine: int, events: Iterable) -> None:
        for ev in events:
            kind = type(ev).__name__
            if getattr(ev, "group_idx", None) not in (None, 0):
                continue  # a hybrid model's other groups: the first group names the prefix
            if kind == "BlockStored":
                self._stored(engine, ev)
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    k = self.names.get((engine, h))
                    if k is not None:
                        self._count(k, engine, ev.medium or "GPU", -1)
            elif kind == "AllBlocksCleared":  # vLLM's own reset: its GPU blocks
                for k, per in self.where.items():
                    per.get(engine, {}).pop("GPU", None)

    def _stored(self, engine: int, ev) -> None:
        if ev.parent_block_hash is None:
            parent = ROOT
        else:
            parent = self.names.get((engine, ev.parent_block_hash))
            if parent is None:
                self.skipped += 1
                return
        toks = list(ev.token_ids)
        for i, h in enumerate(ev.block_hashes):
            k = block_key(parent, toks[i * self.bs:(i + 1) * self.bs])
            self.names[(engine, h)] = k
            self._count(k, engine, ev.medium or "GPU", +1)
            parent = k

    def _count(self, k: bytes, engine: int, medium: str, d: int) -> None:
        m = self.where[k][engine]
        n = m.get(medium, 0) + d
        if n > 0:
            m[medium] = n
        else:
            m.pop(medium, None)

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        out, parent = [], ROOT
        for i in range(len(tokens) // self.bs):
            parent = block_key(parent, tokens[i * self.bs:(i + 1) * self.bs])
            out.append(parent)
        return out

    def scores(self, tokens: Sequence[int], engines: int) -> list[float]:
        """Per engine: the sum over the prompt's leading blocks it holds of its best medium's weight."""
        out = [0.0] * engines
        live = set(range(engines))
        for k in self.keys(tokens):
            per = self.where.get(k, {})
            for e in list(live):
                w = max((WEIGHTS.get(m, 0.0) for m in per.get(e, {})), default=0.0)
                if w <= 0:
                    live.discard(e)
                else:
                    out[e] += w
            if not live:
                break
        return out


class Router:
    def __init__(self, engines: int, policy: str, *, block_size: int):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: one of {', '.join(POLICIES)}")
        self.n, self.policy = engines, policy
        self.index = PrefixIndex(block_size)
        self.load = [0] * engines  # requests in flight per engine
        self.routed = [0] * engines
        self._next = 0
        self.fallbacks = 0  # prefix: requests no engine held any block of

    def apply(self, engine: int, events: Iterable) -> None:
        self.index.apply(engine, events)

    def pick(self, session: str, tokens: Sequence[int]) -> int:
        if self.policy == "round_robin":
            e = self._next
            self._next = (self._next + 1) % self.n
        elif self.policy == "session":
            e = zlib.crc32(session.encode()) % self.n
        else:
            s = self.index.scores(tokens, self.n)
            if max(s) <= 0:
                self.fallbacks += 1  # no engine holds any of it: the queue score alone decides
            total = [PREFIX_WEIGHT * p + QUEUE_WEIGHT * q
                     for p, q in zip(self.prefix_scores(tokens, s), self.queue_scores())]
            best = max(total)
            e = min((i for i, v in enumerate(total) if v >= best - 1e-9), key=lambda i: (self.routed[i], i))
        self.load[e] += 1
        self.routed[e] += 1
        return e

    def prefix_scores(self, tokens: Sequence[int], scores: list[float]) -> list[float]:
        """Per engine, in [0, 1]: its weighted prefix over the prompt's whole blocks."""
        n = len(tokens) // self.index.bs
        return [v / n if n else 0.0 for v in scores]

    def queue_scores(self) -> list[float]:
        """Per engine, in [0, 1]: 1 for the least-loaded, 0 for the most (all 1 when equal)."""
        lo, hi = min(self.load), max(self.load)
        return [1.0 if hi == lo else (hi - q) / (hi - lo) for q in self.load]

    def done(self, engine: int) -> None:
        self.load[engine] -= 1
