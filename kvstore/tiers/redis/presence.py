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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Sequence


class Presence:
    def __init__(self, clock: Callable[[], float], *, ttl_s: float = 1.0, max_keys: int = 8192, probe: int = 16):
        assert ttl_s >= 0 and max_keys > 0 and probe > 0
        self._clock, self.ttl_s, self.max_keys, self.probe = clock, ttl_s, max_keys, probe
        self._seen: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
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
                got = self._seen.get(keys[i])
                if got is None or now - got[1] > self.ttl_s:
                    break
                if not got[0]:
                    return i
                i += 1
        size = self.probe
        while i < len(keys):
            batch = keys[i:i + size]
            found = ask(batch)
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
        """Keys this engine just wrote: present from now on."""
        self._note(keys, True, self._clock())

    def forget(self, keys: Sequence[bytes]) -> None:
        """Keys found gone or bad at a read: ask again next time."""
        with self._lock:
            for k in keys:
                self._seen.pop(k, None)
