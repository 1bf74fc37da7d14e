"""The scheduler's view of a tensor-parallel engine's stores: one per rank, answered as one.

With tensor parallelism every worker holds its own slice of the KV heads and its own store
(its keys carry its rank: the fingerprint's ``tp_rank``), and each rank's store can lose a block
the others still hold (its own DRAM pressure, a damaged file of its own). A hit is worth
offering only where **every** rank can load it: a block one rank lacks fails that rank's load,
and vLLM recomputes the request. So the scheduler asks every rank's store and answers what all of
them hold:

* ``contains_prefix``: the shortest of the ranks' prefixes, each block in the slowest tier any
  rank holds it in, the miss reason of the rank that stopped first;
* ``begin_load``: a pin on every rank, ``got`` the fewest any rank pinned, and the handle a tuple
  of the ranks' handles (each worker takes its own: :class:`~kvstore.offload.runner.StepRunner`'s
  ``rank``); ``end_load`` ends each;
* ``prefetch``: one per rank, done when all are; ``record_request``: rank 0's metrics only (one
  request, counted once); ``saves_done``: never asked (every rank reports its own stores through
  vLLM's ``finished_sending``).

A rank that cannot be asked fails the call (a miss for the scheduler, as for one store).
"""

from __future__ import annotations

from typing import Sequence

from kvstore.offload.client import MAX_PREFETCHES, StoreClient
from kvstore.offload.metrics import RequestOutcome
from kvstore.offload.shared import new_id
from kvstore.store import PrefixMatch
from kvstore.tiers.registry import rank



class RankedClient:
    def __init__(self, clients: Sequence[StoreClient]):
        if not clients:
            raise ValueError("a tensor-parallel engine has at least one rank")
        self.clients = list(clients)
        self._prefetches: dict[int, tuple] = {}  # token -> the ranks' tokens


    def contains_prefix(self, keys, record=False, num_tokens=None, held=0) -> PrefixMatch:
        ms = [c.contains_prefix(keys, record=record and i == 0, num_tokens=num_tokens, held=held)
              for i, c in enumerate(self.clients)]
        low = min(ms, key=lambda m: m.num_blocks)
        n = low.num_blocks
        tiers = tuple(max((m.tiers[i] for m in ms), key=rank) for i in range(n))
        return PrefixMatch(n, tiers, low.miss_reason if n < len(keys) else None)

    def prefetch(self, keys) -> int:
        tokens = tuple(c.prefetch(keys) for c in self.clients)
        if len(self._prefetches) >= MAX_PREFETCHES:  # the oldest goes: asked again, it answers done
            del self._prefetches[next(iter(self._prefetches))]
        token = new_id()
        self._prefetches[token] = tokens
        return token

    def prefetch_done(self, token: int) -> bool:
        tokens = self._prefetches.get(token)
        if tokens is None or all(c.prefetch_done(t) for c, t in zip(self.clients, tokens)):
            self._prefetches.pop(token, None)
            return True
        return False

    def begin_load(self, keys, session=None, ttl_s=None) -> tuple[tuple, int, tuple[str, ...]]:
        pins = []
        try:
            for c in self.clients:
                pins.append(c.begin_load(keys, session=session, ttl_s=ttl_s))
        except BaseException:
            for c, (hid, _, _) in zip(self.clients, pins):  # no rank keeps a pin nobody will load
                try:
                    c.end_load(hid)
                except Exception:
                    pass
            raise
        got = min(p[1] for p in pins)
        tiers = tuple(max((p[2][i] for p in pins), key=rank) for i in range(got))
        return tuple(p[0] for p in pins), got, tiers

    def end_load(self, handle_id) -> None:
        errors = []
        for c, hid in zip(self.clients, handle_id):
            try:
                c.end_load(hid)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def record_request(self, outcome: RequestOutcome) -> None:
        self.clients[0].record_request(outcome)

    def saves_done(self, req_id: str, timeout: float = 0.0) -> bool:
        return all(c.saves_done(req_id, timeout) for c in self.clients)

    def close(self) -> None:
        for c in self.clients:
            c.close()
