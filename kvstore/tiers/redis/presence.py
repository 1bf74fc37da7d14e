"""What the remote tier answered about keys a moment ago, so one request asks Redis once.

vLLM asks for a request's stored prefix on the scheduler thread (the lookup), then pins it for
the load a few milliseconds later: two lookup pipelines over the same keys (EXISTS when this was
measured, STRLEN now: as cheap), each ~5 ms for 256
keys on loopback (measured with the two-engine test). ``walk`` answers the second from this memo.
And a prompt that misses (most fresh prompts) asks ``probe`` keys first, not all of them: only
the prefix counts, so the first absent key ends the walk.

An answer is kept ``ttl_s`` (1 s) and at most ``max_keys``; a stale "present" costs what a key
evicted by Redis between the lookup and the load already costs (a miss at load, recomputed), a
stale "absent" a hit missed for a second. Pure apart from the ``ask`` callable; the clock is
passed in.

A value this engine refused and kept (its checksum or MAC failed: not deleted, see
:mod:`.value`) still has the length of a good one, so Redis would keep answering "present" and
every lookup would promise a block whose every load fails (a wasted read of up to the value, then
a recompute). Such a key is held absent ``refused_s`` (60 s) here, whatever Redis says; this
engine's own store of the key ends the hold at once (and overwrites the value), and a good value
another engine writes over it meanwhile is missed here for at most the hold.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Sequence


class Presence:
    def __init__(self, clock: Callable[[], float], *, ttl_s: float = 1.0, max_keys: int = 8192, probe: int = 16,
                 refused_s: float = 60.0):
        assert ttl_s >= 0 and max_keys > 0 and probe > 0 and refused_s >= 0
        self._clock, self.ttl_s, self.max_keys, self.probe = clock, ttl_s, max_keys, probe
        self.refused_s = refused_s
        self._seen: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self._refused: OrderedDict[bytes, float] = OrderedDict()  # key -> held absent until
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def walk(self, keys: Sequence[bytes], ask: Callable[[Sequence[bytes]], list[bool]]) -> int:
        """How many leading ``keys`` are present: the memo first, then ``ask`` for the rest
        (``probe`` keys, then all the others if those were all present)."""
        now = self._clock()
        i = 0
        with self._lock:
            while i < len(keys):
                if self._held(keys[i], now):
                    return i
                got = self._seen.get(keys[i])
                if got is None or now - got[1] > self.ttl_s:
                    break
                if not got[0]:
                    return i
                i += 1
        size = self.probe
        while i < len(keys):
            batch = keys[i:i + size]
            found = self.unheld(batch, ask(batch))
            m = next((j for j, ok in enumerate(found) if not ok), len(batch))
            self._note(batch[:m], True, now)
            if m < len(batch):
                self._note(batch[m:m + 1], False, now)
                return i + m
            i += m
            size = len(keys)
        return i

    def _note(self, keys: Sequence[bytes], present: bool, now: float) -> None:
        with self._lock:
            for k in keys:
                self._seen[k] = (present, now)
                self._seen.move_to_end(k)
            while len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)

    def stored(self, keys: Sequence[bytes]) -> None:
        """Keys this engine just wrote: present from now on (a hold ends)."""
        with self._lock:
            for k in keys:
                self._refused.pop(k, None)
        self._note(keys, True, self._clock())

    def refused(self, keys: Sequence[bytes]) -> None:
        """Keys whose value a read refused and kept: absent for ``refused_s``."""
        until = self._clock() + self.refused_s
        with self._lock:
            for k in keys:
                self._refused[k] = until
                self._refused.move_to_end(k)
                self._seen.pop(k, None)
            while len(self._refused) > self.max_keys:
                self._refused.popitem(last=False)

    def unheld(self, keys: Sequence[bytes], found: Sequence[bool]) -> list[bool]:
        """``found`` (Redis's answer for ``keys``) with the held keys absent."""
        now = self._clock()
        with self._lock:
            if not self._refused:
                return list(found)
            return [f and not self._held(k, now) for k, f in zip(keys, found)]

    def _held(self, key: bytes, now: float) -> bool:
        until = self._refused.get(key)
        if until is None:
            return False
        if now < until:
            return True
        del self._refused[key]
        return False

    def forget(self, keys: Sequence[bytes]) -> None:
        """Keys found gone or bad at a read: ask again next time (a hold stays)."""
        with self._lock:
            for k in keys:
                self._seen.pop(k, None)
