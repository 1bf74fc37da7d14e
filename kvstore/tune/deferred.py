"""The replay's I/O pool: an executor that runs nothing until asked.

:class:`kvstore.tune.simulate.Simulator` hands it to its :class:`kvstore.store.KVStore` in place
of the store's threads (as does the tests' replay through a real store, ``tests/store_replay.py``).
The store starts its background moves on it as on the real pool (demotions, write-through
copies, files of victims); the replay runs them at the end of each store call, in the order
they started: its model of time, without a thread. A job whose result the store waits for (its
own batched reads and writes, ``Transfers._map``) runs at once, alone.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Executor, Future


class _Job(Future):
    def __init__(self, pool: "Deferred", fn, args, kwargs):
        super().__init__()
        self.pool, self.fn, self.args, self.kwargs = pool, fn, args, kwargs

    def result(self, timeout=None):
        if not self.done():  # waited for: it runs now (the others keep their turn)
            self.pool._jobs.remove(self)
            self.run()
        return super().result(timeout)

    def run(self) -> None:
        self.set_running_or_notify_cancel()
        try:
            self.set_result(self.fn(*self.args, **self.kwargs))
        except BaseException as e:  # the store reads it where it waits; a background job's is counted there
            self.set_exception(e)


class Deferred(Executor):
    def __init__(self):
        self._jobs: deque[_Job] = deque()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f = _Job(self, fn, args, kwargs)
        self._jobs.append(f)
        return f

    def map(self, fn, *iterables, timeout=None, chunksize=1):
        return [fn(*a) for a in zip(*iterables)]

    def run(self) -> int:
        """Run what was started, jobs they start included, in order. Returns how many ran."""
        n = 0
        while self._jobs:
            self._jobs.popleft().run()
            n += 1
        return n

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.run()
