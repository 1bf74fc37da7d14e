"""The worker's copy jobs, off the engine's forward thread (issue 13).

Two daemon threads, one per direction, so a load never waits in a queue behind a store: loads
(NVMe reads and the scatter of a request that waits in ``WAITING_FOR_REMOTE_KVS``) and stores (the
gather of a step's newly full blocks into DRAM slots, then the commit). A job is a callable; what
it reports is kept here until the connector hands it to vLLM:

* a load job returns the engine block ids it could not fill; ``take_loads()`` returns the
  requests whose loads completed and those ids together, so vLLM never sees a request as
  loaded before it sees which of its blocks failed (and, for loads that are all or nothing, the
  requests that failed: a hybrid model's failure is reported per request);
* store jobs are counted per request. The engine's blocks stay allocated until a request's
  stores completed: ``saves_done(req)`` (scheduler side, at ``request_finished``) waits a
  little and, if they are still running, leaves the request marked so that ``finished_sending``
  reports it once they are (``get_finished``).

A store job names the engine blocks it reads (``sources``): a block vLLM frees while its request
runs (sliding window, Mamba states) may be given to another request in the next step, so the
worker waits for the gathers still reading it (``wait_sources``) before that step's forward pass
or a load into it.

Nothing here raises into the engine: a job that raises is logged and its request reported done
(a failed store stores nothing; a failed load reports every block of the request as failed).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from typing import Callable, Iterable

log = logging.getLogger(__name__)


class CopyJobs:
    def __init__(self, name: str = "kvstore"):
        self._cond = threading.Condition()
        self._saving: dict[str, int] = {}  # request -> store jobs queued or running
        self._stored: set[str] = set()  # requests that had stores submitted (their frees may wait)
        self._finished: set[str] = set()  # of those, the ones vLLM said finished (get_finished)
        self._loaded: set[str] = set()  # async loads done, not yet reported
        self._load_errors: set[int] = set()  # engine blocks of those loads that failed
        self._failed: set[str] = set()  # requests whose all-or-nothing load failed
        self._sources: Counter = Counter()  # engine blocks read by store jobs queued or running
        self._loading = 0
        self.counts = {"loads": 0, "stores": 0, "delayed_frees": 0, "fenced": 0}  # jobs done, frees left to vLLM, waits
        self._closed = False
        self._queues = {"load": queue.SimpleQueue(), "store": queue.SimpleQueue()}
        self._threads = [threading.Thread(target=self._run, args=(k,), name=f"{name}-{k}", daemon=True)
                         for k in self._queues]
        for t in self._threads:
            t.start()

    # -- submitting (worker's forward thread) --------------------------------------------------
    def submit_store(self, req_ids: Iterable[str], fn: Callable[[], None], sources: Iterable[int] = ()) -> None:
        reqs = sorted(set(req_ids))
        src = tuple(sources)
        with self._cond:
            for r in reqs:
                self._saving[r] = self._saving.get(r, 0) + 1
                self._stored.add(r)
            self._sources.update(src)
        self._queues["store"].put((fn, (reqs, src)))

    def mark_stored(self, req_ids: Iterable[str]) -> None:
        """Requests whose stores were planned but not submitted (nothing to copy): their frees
        follow the same protocol, so the scheduler's view and ours agree."""
        with self._cond:
            self._stored.update(req_ids)

    def submit_load(self, req_id: str, fn: Callable[[], set[int]], block_ids: Iterable[int],
                    whole: bool = False) -> None:
        """``whole``: the load is all or nothing (a failed block fails the request)."""
        with self._cond:
            self._loading += 1
        self._queues["load"].put((fn, (req_id, tuple(block_ids), whole)))

    # -- the threads ---------------------------------------------------------------------------
    def _run(self, kind: str) -> None:
        q = self._queues[kind]
        while True:
            item = q.get()
            if item is None:
                return
            fn, arg = item
            if kind == "load":
                req_id, block_ids, whole = arg
                try:
                    failed = set(fn())
                except BaseException as e:  # never lose the request: every block failed, vLLM recomputes
                    log.warning("kvstore: async load of %s failed (%s: %s)", req_id, type(e).__name__, e)
                    failed = set(block_ids)
                with self._cond:
                    self.counts["loads"] += 1
                    self._loaded.add(req_id)
                    if whole and failed:
                        self._failed.add(req_id)
                    elif failed:
                        self._load_errors |= failed
                    self._loading -= 1
                    self._cond.notify_all()
            else:
                try:
                    fn()
                except BaseException as e:  # the job stores nothing; its blocks are a later miss
                    log.warning("kvstore: async store failed (%s: %s)", type(e).__name__, e)
                reqs, src = arg
                with self._cond:
                    self.counts["stores"] += 1
                    self._sources.subtract(src)
                    for b in src:
                        if self._sources[b] <= 0:
                            del self._sources[b]
                    for r in reqs:
                        n = self._saving.get(r, 0) - 1
                        if n > 0:
                            self._saving[r] = n
                        else:
                            self._saving.pop(r, None)
                    self._cond.notify_all()

    # -- completion ----------------------------------------------------------------------------
    def saves_done(self, req_id: str, timeout: float = 0.0) -> bool:
        """True when no store of ``req_id`` is queued or running (waiting up to ``timeout``); the
        request is then forgotten here (its blocks may be freed now). False: it stays marked and
        ``finished_sending`` reports it once its stores completed."""
        with self._cond:
            self._cond.wait_for(lambda: self._saving.get(req_id, 0) == 0, timeout=timeout)
            if self._saving.get(req_id, 0):
                self.counts["delayed_frees"] += 1
                return False
            self._stored.discard(req_id)
            self._finished.discard(req_id)
            return True

    def wait_saves(self, req_ids: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until the stores of ``req_ids`` (all when None) completed, e.g. before the blocks of
        preempted requests are reused."""
        ids = None if req_ids is None else set(req_ids)
        with self._cond:
            return self._cond.wait_for(
                lambda: not any(ids is None or r in ids for r in self._saving), timeout=timeout)

    def wait_sources(self, block_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until no queued or running store job reads any of ``block_ids`` (they are about
        to be written: given to another request, or the target of a load)."""
        ids = set(block_ids)
        with self._cond:
            if not self._sources or self._sources.keys().isdisjoint(ids):
                return True
            self.counts["fenced"] += 1
            return self._cond.wait_for(lambda: self._sources.keys().isdisjoint(ids), timeout=timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued job (loads and stores) completed."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._saving and self._loading == 0, timeout=timeout)

    def finished_sending(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Of the requests vLLM said finished (in this call or an earlier one), those that had
        stores, were not released by ``saves_done``, and whose stores completed; each once."""
        if not finished_req_ids and not self._finished:  # most steps: nothing to report, no lock
            return set()  # (only this method adds to _finished; saves_done only removes)
        with self._cond:
            self._finished |= self._stored.intersection(finished_req_ids)
            out = {r for r in self._finished if not self._saving.get(r)}
            self._stored -= out
            self._finished -= out
        return out

    def wait_load(self, timeout: float) -> bool:
        """Wait (without the GIL) until some async load completed or none is running."""
        with self._cond:
            return self._cond.wait_for(lambda: self._loaded or not self._loading, timeout=timeout)

    def take_loads(self) -> tuple[set[str], set[int], set[str]]:
        """Requests whose async loads completed, the engine blocks among them that failed, and
        the requests among them whose all-or-nothing load failed."""
        if not (self._loaded or self._load_errors or self._failed):  # most steps, read without the lock:
            return set(), set(), set()  # a load completing meanwhile is taken at the next step
        with self._cond:
            done, bad, failed = self._loaded, self._load_errors, self._failed
            self._loaded, self._load_errors, self._failed = set(), set(), set()
        return done, bad, failed

    def close(self, timeout: float | None = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.wait_idle(timeout)
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout)
