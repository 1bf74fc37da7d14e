"""A model store's KV-event records in a node daemon, read by every engine attached to it.

An embedded store's journal has one reader, its engine. A daemon's store has many: each engine
announces, on its own KV-event stream, the blocks of the daemon it can load (so a router sees that
a prefix engine A computed is a CPU hit on engine B). The daemon drains the store's journal
(:meth:`KVStore.take_events`) into this log, a bounded list of records numbered in order, and each
engine reads from its own cursor:

* an engine's first read starts with every block the store holds (with its engine name known),
  paged: a snapshot of the held keys, shared by the readers that start while its place in the log
  is still there, is encoded a page a read (all at once, 50k blocks took 0.9 s here, 0.2 s to list
  and 0.65 s to encode, past an engine's call timeout); then the records after that point: what it announces
  matches what it could load;
* a reader the log ran past (its records dropped, the log at ``MAX_RECORDS`` or ``MAX_BYTES``) is
  counted (``lost``) and reads the held blocks again: stale BlockStored records are corrected, but a
  removal it missed may stay announced until the block is stored and removed again;
* a read whose reply never reached the engine is asked for again (``again``): the reader goes back
  to where that read began;
* the daemon drains the journal every ``DRAIN_S`` whether or not any engine reads (which runs the
  store's TTL sweeps too), so an unread journal never grows.

Records travel as ``[stored, tier, BlockMeta.encode()]`` (JSON and int32 tokens, never pickled).
"""

from __future__ import annotations

import threading
from collections import deque

from kvstore.store.events import STORED, BlockMeta

MAX_RECORDS = 1 << 16  # ~20 s of a busy engine's stores and evictions at 3k blocks/s
# and at most this many bytes of names: 65,536 records of 16-token blocks are ~14 MiB (a 64-hex
# hash, its parent's, 64 bytes of tokens), of 1,024-token blocks ~265 MiB without it
MAX_BYTES = 64 << 20
READ_LIMIT = 4096  # records one read returns (the log's are encoded already: a copy of references)
HELD_PAGE = 1024  # held blocks one read looks at: 6-13 ms of encoding their names (6-13 us a block)
# bytes of names one read returns (past the first record): a reply stays under 4 MiB plus one
# record (at most meta_cap(1M tokens), 4 MiB), well under the wire's 16 MiB frame
READ_BYTES = 4 << 20
DRAIN_S = 0.5


def meta_cap(block_tokens: int) -> int:
    """The most bytes of one block's name (``BlockMeta.encode``): its tokens at 4 bytes each, and
    1 KiB for the rest (two 64-hex hashes and the JSON around them are ~150 bytes; the rest leaves
    room for a LoRA name, a cache salt or a few multimodal hashes). A longer name is not announced."""
    return 4 * block_tokens + 1024


class Reader:
    """One engine's place in a log: the held blocks it has still to read, then its cursor."""

    def __init__(self) -> None:
        self.held: list | None = None  # a snapshot of the held keys [(tier, keys)] still to page through
        self.at = (0, 0)  # where in it: (tier, key)
        self.cursor: int | None = None  # None: the held blocks are read first
        self.last: tuple | None = None  # (held, at, cursor) before the last read, for a read asked again
        self.lock = threading.Lock()  # two connections of one engine never read at once


class EventLog:
    def __init__(self, store):
        self.store = store
        self.records: deque = deque()
        self.bytes = 0  # of the names in records
        self.first = 0  # the number of records[0]
        self.lost = 0  # readers the log ran past
        self.lock = threading.Lock()
        self._draining = threading.Lock()  # one drain at a time: the records stay in the journal's order
        self._snapshot: tuple[int, list] | None = None  # (its place in the log, [(tier, keys)])

    @property
    def end(self) -> int:
        return self.first + len(self.records)

    def drain(self) -> None:
        """Move the store's journal into the log (the store sweeps past-TTL blocks as it does)."""
        with self._draining:
            recs = self.store.take_events()
            if not recs:
                return
            recs = [[stored, tier, m.encode()] for stored, tier, m in recs]
            with self.lock:
                self.records.extend(recs)
                self.bytes += sum(len(rec[2]) for rec in recs)
                while self.records and (len(self.records) > MAX_RECORDS or self.bytes > MAX_BYTES):
                    self.bytes -= len(self.records.popleft()[2])
                    self.first += 1

    def read(self, r: Reader, again: bool = False) -> list:
        """The records ``r`` has not read: at most READ_LIMIT, and READ_BYTES of names past the
        first. ``again``: the reply to the last read never came; it is read again."""
        with r.lock:
            self.drain()
            if again and r.last is not None:
                r.held, r.at, r.cursor = r.last
            r.last = (r.held, r.at, r.cursor)
            if r.cursor is not None and r.cursor < self.first:
                self.lost += 1
                r.cursor = None
            if r.cursor is None:
                r.cursor, r.held = self._held()
                r.at = (0, 0)
            if r.held is not None:
                out = self._page(r)
                if out or r.held is not None:
                    return out
            with self.lock:
                i, out, size = r.cursor - self.first, [], 0
                for j in range(i, min(len(self.records), i + READ_LIMIT)):
                    if out and size >= READ_BYTES:
                        break
                    out.append(self.records[j])
                    size += len(self.records[j][2])
            r.cursor += len(out)
            return out

    def _held(self) -> tuple[int, list]:
        """(a place in the log, the keys every announced local tier held after it): the last
        snapshot while its place is still in the log, else a new one. The blocks that change after
        the place are in the records that follow it (read twice at worst: stored or removed again)."""
        with self.lock:
            snap, end = self._snapshot, self.end
            if snap is not None and snap[0] >= self.first:
                return snap
        # as TierEvents.held, without encoding a name (a shared tier vouches for none of its keys)
        held = [(t.name, t.held_keys()) for t in self.store.events.tiers if not t.shared]
        with self.lock:
            self._snapshot = (end, held)
        return end, held

    def _page(self, r: Reader) -> list:
        """The next page of ``r``'s held blocks (HELD_PAGE keys looked at, READ_BYTES of names);
        ``r.held`` is None once they are all read."""
        meta, out, size = self.store.events.meta, [], 0
        (i, j), looked = r.at, 0
        while i < len(r.held) and looked < HELD_PAGE and not (out and size >= READ_BYTES):
            tier, keys = r.held[i]
            if j >= len(keys):
                i, j = i + 1, 0
                continue
            m = meta.get(keys[j])
            j, looked = j + 1, looked + 1
            if m is not None:  # no name (an engine without events), or it went since the snapshot
                body = m.encode()
                out.append([STORED, tier, body])
                size += len(body)
        r.at = (i, j)
        if i >= len(r.held):
            r.held = None
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
