"""What each tier holds, as a stream of "stored" and "removed" records for vLLM's KV-event stream
(issue 32). No vLLM here: a record carries the block's :class:`BlockMeta` as the connector gave it
(``kvstore.connectors.vllm.events`` makes vLLM's ``BlockStored``/``BlockRemoved`` of them).

* The truth is each tier's index: :class:`~kvstore.tiers.index.TierIndex` journals an entry that
  becomes READY (servable) and a READY entry that leaves it (evicted, expired, failed its checksum,
  its file gone, demoted out, removed). :meth:`TierEvents.take` drains the journals.
* The metadata comes from the engine (``remember``: vLLM's block hash, parent, token ids, extra
  keys, KV cache group) and, after a restart, from the block files the NVMe scan found (the tier
  keeps it in each file: :mod:`kvstore.tiers.fileformat`). A block without metadata is served
  but never announced, and so never announced removed either.
* What the tiers held when the events were attached (the restart scan's blocks) is announced by
  the first ``take``.
"""

from __future__ import annotations

import json
import struct
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstore.tiers.index import READY

STORED = True
REMOVED = False
_HEAD = struct.Struct("<H")


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """One block as the engine names it: what a KV-event consumer needs to index it."""

    block_hash: bytes  # the engine's own block hash (vLLM: the raw BlockHash bytes)
    parent: bytes | None  # the previous block's hash (None: the first block)
    token_ids: tuple[int, ...]
    group: int = 0  # KV cache group
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple | None = None  # the event's form (vllm to_event_extra_keys: untagged)

    def encode(self) -> bytes:
        """JSON of everything but the tokens, then the tokens as int32 (never pickled)."""
        head = json.dumps([self.block_hash.hex(), self.parent.hex() if self.parent is not None else None,
                           self.group, self.lora_id, self.lora_name, self.extra_keys],
                          separators=(",", ":")).encode()
        return _HEAD.pack(len(head)) + head + np.asarray(self.token_ids, dtype="<i4").tobytes()

    @staticmethod
    def decode(body: bytes) -> "BlockMeta | None":
        """A file's metadata (already checked against its key), or None if it does not parse."""
        try:
            (n,) = _HEAD.unpack_from(body)
            h, p, g, lid, lname, extra = json.loads(body[_HEAD.size:_HEAD.size + n])
            toks = np.frombuffer(body[_HEAD.size + n:], dtype="<i4")
            return BlockMeta(bytes.fromhex(h), bytes.fromhex(p) if p is not None else None,
                             tuple(int(t) for t in toks), int(g), lid, lname,
                             tuple(tuple(x) if isinstance(x, list) else x for x in extra) if extra else None)
        except (ValueError, TypeError, struct.error):
            return None


class TierEvents:
    """The journals of the ``announced`` tiers (each tier keeps its own: a local tier's index, a
    shared tier what this engine wrote there and found gone) and the metadata of the blocks they
    hold."""

    def __init__(self, tiers: Sequence, announced: Sequence[str]):
        self.all = [t for t in tiers if not t.shared]  # every local tier (a key held anywhere)
        self.tiers = [t for t in tiers if t.name in announced]
        self.meta: dict[bytes, BlockMeta] = {}
        self._lock = threading.Lock()
        self._gone: list[list[bytes]] = [[], []]  # keys that may be held nowhere, checked two takes later
        self._first: list[tuple[str, bytes]] = []
        for t in self.all:  # a medium that keeps the metadata itself (a restart announces its blocks)
            for k, body in t.keep_meta(self._body_of).items():
                m = BlockMeta.decode(body)
                if m is not None:
                    self.meta[k] = m
        for t in self.tiers:
            self._first.extend((t.name, k) for k in t.journal_on())
        # the local tiers not announced journal too: what leaves them is never sent, but its
        # metadata must go once no tier holds the block (a block demoted into an NVMe tier that is
        # not announced, then evicted there, left its metadata here for good)
        announced = {id(t) for t in self.tiers}
        self._quiet = [t for t in self.all if id(t) not in announced]
        for t in self._quiet:
            t.journal_on()
        held = {k for t in self.all for k in t.held_keys()}
        self.meta = {k: m for k, m in self.meta.items() if k in held or any(t.state_of(k) is not None for t in self.all)}

    def _body_of(self, key: bytes) -> bytes | None:
        m = self.meta.get(key)
        return m.encode() if m is not None else None

    def remember(self, keys: Sequence[bytes], metas: Sequence[BlockMeta | None]) -> None:
        """The engine's names of blocks about to be stored (before their reservation)."""
        with self._lock:
            for k, m in zip(keys, metas):
                if m is not None:
                    self.meta[k] = m
                    self._gone[1].append(k)  # not admitted, no room: forgotten two takes later

    def held(self) -> list[tuple[bool, str, BlockMeta]]:
        """(STORED, tier name, metadata) of every block the announced local tiers hold now (a node
        daemon's new reader starts from these)."""
        out = []
        for t in self.tiers:
            out.extend((STORED, t.name, m) for k in t.held_keys() if (m := self.meta.get(k)) is not None)
        return out

    def due(self, now: float) -> bool:
        """Is anything past its TTL in a local tier (a sweep would remove it)?"""
        return any(t.due(now) for t in self.all)

    def take(self) -> list[tuple[bool, str, BlockMeta]]:
        """(STORED or REMOVED, tier name, metadata) since the last call, in order per tier."""
        out: list[tuple[bool, str, BlockMeta]] = []
        meta = self.meta
        first, self._first = self._first, []
        for name, k in first:
            m = meta.get(k)
            if m is not None:
                out.append((STORED, name, m))
        gone: list[bytes] = []
        for t in self.tiers:
            for stored, k in t.journal_take():
                m = meta.get(k)
                if m is None:
                    continue
                out.append((stored, t.name, m))
                if not stored:
                    gone.append(k)
        for t in self._quiet:
            gone.extend(k for stored, k in t.journal_take() if not stored)
        with self._lock:  # metadata of blocks no tier holds any more (a demotion in flight is held below)
            old, newer = self._gone
            again = []
            for k in old:
                held = [st for t in self.all if (st := t.state_of(k)) is not None]
                if not held:
                    meta.pop(k, None)
                elif READY not in held:  # only being written: an abort journals nothing, so look again
                    again.append(k)
            self._gone = [newer + again, gone]
        return out
