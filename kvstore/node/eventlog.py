"""A model store's KV-event records in a node daemon, read by every engine attached to it.

An embedded store's journal has one reader, its engine. A daemon's store has many: each engine
announces, on its own KV-event stream, the blocks of the daemon it can load (so a router sees that
a prefix engine A computed is a CPU hit on engine B). The daemon drains the store's journal
(:meth:`KVStore.take_events`) into this log, a bounded list of records numbered in order, and each
engine reads from its own cursor:

* an engine's first read is every block the store holds (with its engine name known), then the
  records after that point: what it announces matches what it could load;
* a reader the log ran past (its records dropped, the log at ``MAX_RECORDS``) is counted
  (``lost``) and reads the held blocks again: stale BlockStored records are corrected, but a
  removal it missed may stay announced until the block is stored and removed again;
* the daemon drains the journal every ``DRAIN_S`` whether or not any engine reads (which runs the
  store's TTL sweeps too), so an unread journal never grows.

Records travel as ``[stored, tier, BlockMeta.encode()]`` (JSON and int32 tokens, never pickled).
"""

from __future__ import annotations

import threading
from collections import deque

from kvstore.store.events import STORED, BlockMeta

MAX_RECORDS = 1 << 16  # ~20 s of a busy engine's stores and evictions at 3k blocks/s
READ_LIMIT = 4096  # records one call returns (a held list is paged through)
DRAIN_S = 0.5


class Reader:
    """One engine's place in a log: the held blocks it has still to read, then its cursor."""

    def __init__(self) -> None:
        self.cursor: int | None = None  # None: the held blocks are read first
        self.backlog: list = []
        self.lock = threading.Lock()  # two connections of one engine never read at once


class EventLog:
    def __init__(self, store):
        self.store = store
        self.records: deque = deque()
        self.first = 0  # the number of records[0]
        self.lost = 0  # readers the log ran past
        self.lock = threading.Lock()
        self._draining = threading.Lock()  # one drain at a time: the records stay in the journal's order

    @property
    def end(self) -> int:
        return self.first + len(self.records)

    def drain(self) -> None:
        """Move the store's journal into the log (the store sweeps past-TTL blocks as it does)."""
        with self._draining:
            recs = self.store.take_events()
            if not recs:
                return
            with self.lock:
                self.records.extend([stored, tier, m.encode()] for stored, tier, m in recs)
                over = max(0, len(self.records) - MAX_RECORDS)
                for _ in range(over):
                    self.records.popleft()
                self.first += over

    def read(self, r: Reader) -> list:
        """The records ``r`` has not read, at most READ_LIMIT."""
        with r.lock:
            self.drain()
            if r.cursor is not None and r.cursor < self.first:
                self.lost += 1
                r.cursor = None
            if r.cursor is None:
                with self.lock:
                    r.cursor = self.end  # what is drained after this is read from the log
                r.backlog = [[STORED, tier, m.encode()] for _, tier, m in self.store.events.held()]
            if r.backlog:
                out, r.backlog = r.backlog[:READ_LIMIT], r.backlog[READ_LIMIT:]
                return out
            with self.lock:
                i = r.cursor - self.first
                out = [self.records[j] for j in range(i, min(len(self.records), i + READ_LIMIT))]
            r.cursor += len(out)
            return out


def decode(records) -> list:
    """An engine's side: (stored, tier, BlockMeta) of records read off the wire; a record that does
    not parse is dropped."""
    out = []
    if not isinstance(records, list):
        return out
    for rec in records:
        if not (isinstance(rec, list) and len(rec) == 3 and isinstance(rec[0], bool) and isinstance(rec[1], str)
                and isinstance(rec[2], bytes)):
            continue
        m = BlockMeta.decode(rec[2])
        if m is not None:
            out.append((rec[0], rec[1], m))
    return out
