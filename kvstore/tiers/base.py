"""The tier contract: what the chain (:mod:`kvstore.store.chain`) asks of every medium.

A tier is an index (what it holds, capacity, TTL, pins) plus a medium (the bytes). Index work is
cheap and runs under the tier's own lock; data moves (``read``/``write``) run outside it, on
entries that are pinned, so they can run on an I/O pool.

Writes are two-phase: :meth:`Tier.begin_reserve` makes room and returns WRITING entries plus the
*victims* it pushed out (expired or evicted), each still holding its medium; the caller decides
what each one needs (the chain writes a DRAM victim down to NVMe) and returns it with
:meth:`Tier.free`; :meth:`Tier.attach` gives the new entries their medium without waiting (no
free slot: dropped and counted); :meth:`Tier.commit` publishes them. Reads pin entries
(:meth:`Tier.acquire`) and unpin them (:meth:`Tier.release`; a failed read drops the entry).

Two kinds: a *local* tier (:class:`kvstore.tiers.local.LocalTier`: DRAM, NVMe, the tuner's
byte-less tiers) keeps its own index; a *shared* tier (``shared = True``: Redis) is written by
every engine and keeps its index itself, so it is asked in batches (:meth:`leading`,
:meth:`holds`), reserves nothing and pins nothing; its victims, if its medium keeps a capacity
itself (a shared folder's sweeper), come out of :meth:`expire` (:mod:`kvstore.tiers.shared`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from kvstore.tiers.index import Entry


class Reservation(list):
    """What :meth:`Tier.begin_reserve` returns: a list of WRITING entries (None where the key is
    present, pending or there is no room) plus ``victims`` (entries that left the index, each
    still holding its medium until :meth:`Tier.free`) and, after :meth:`Tier.attach`,
    ``no_slot`` (entries dropped for want of a free slot); ``pinned``: entries never reserved, the
    index having no room (every entry held by a write or a pin)."""

    victims: list[Entry]
    no_slot: int
    pinned: int

    def __init__(self, entries=(), victims=None):
        super().__init__(entries)
        self.victims = victims if victims is not None else []
        self.no_slot = 0
        self.pinned = 0


class Tier(ABC):
    name: str = "tier"
    shared: bool = False  # every engine writes it; asked in batches, never pinned (Redis)
    addressable: bool = False  # its slots are memory the caller copies into and out of in place (DRAM)
    fan_out: bool = False  # each block's I/O is worth a thread of the pool (NVMe files)
    spreads: bool = False  # a fan_out tier whose batch calls spread over threads themselves (one call a batch)
    write_through: bool = False  # copy every block stored above into it at once (else: victims only)
    admit_after: int = 0  # a block is written into it only after this many asks (placement.Admission)

    # -- lookups -----------------------------------------------------------------------------------
    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """READY and unexpired."""

    def serving(self, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` are READY and unexpired (one batch)."""
        return [self.contains(k) for k in keys]

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` it holds."""
        n = 0
        for k in keys:
            if not self.contains(k):
                break
            n += 1
        return n

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` it holds or is writing (one batch)."""
        return [self.present_or_writing(k) for k in keys]

    @abstractmethod
    def present_or_writing(self, key: bytes) -> bool:
        """READY and unexpired, or being written."""

    def is_expired(self, key: bytes) -> bool:
        """Still indexed, but past its TTL (not yet swept)."""
        return False

    def consult(self, what: str) -> None:
        """Its ``capacity`` or ``ttl`` decided something (for the tuner, which skips settings
        whose value never mattered)."""

    # -- writes ------------------------------------------------------------------------------------
    @abstractmethod
    def begin_reserve(self, keys: Sequence[bytes], ttl: float | None = None) -> Reservation:
        """Phase 1 of a write, index only (see the module doc)."""

    def attach(self, res: Reservation) -> Reservation:
        """Give reserved entries their medium, never waiting (none free: None, ``res.no_slot``)."""
        return res

    @abstractmethod
    def commit(self, entries: Sequence[Entry | None], oks: Sequence[bool], at: float | None = None,
               session: str | None = None, keep_pinned: bool = False) -> None:
        """Phase 2: publish written entries (``keep_pinned``: still pinned, for a caller that
        reads them next), drop failed ones."""

    def abort(self, entries: Sequence[Entry | None]) -> None:
        """Drop reserved entries never written."""
        self.commit(entries, [False] * len(entries))

    # -- reads -------------------------------------------------------------------------------------
    @abstractmethod
    def acquire(self, keys: Sequence[bytes], session: str | None = None, touch: bool = True) -> list[Entry | None]:
        """Pin entries for reading (a shared tier: entries for keys it was found to hold)."""

    def touch(self, entries: Sequence[Entry | None], session: str | None = None, ttl: float | None = None) -> None:
        """Count pinned entries as hits (recency, TTL; ``ttl``: a retention hint)."""

    @abstractmethod
    def release(self, entries: Sequence[Entry | None], oks: Sequence[bool] | None = None) -> None:
        """Unpin after a read; an entry whose read failed leaves the index at once."""

    def pin_all(self) -> list[Entry]:
        """Every READY entry pinned, the policy's first victims first (for a write-back)."""
        return []

    # -- time and room -----------------------------------------------------------------------------
    def expire(self, limit: int | None = None) -> list[Entry]:
        """Take what is due out of the index (bounded); the victims keep their medium until :meth:`free`."""
        return []

    def free(self, victims: Sequence[Entry]) -> None:
        """Release the medium of entries that left the index."""

    # -- the medium (no lock held; entries pinned) -------------------------------------------------
    @abstractmethod
    def write(self, entry: Entry, src: np.ndarray) -> bool:
        """Store ``src`` (block_bytes of uint8) for a reserved entry. False on failure."""

    @abstractmethod
    def read(self, entry: Entry, out: np.ndarray) -> bool:
        """Fill ``out`` with a pinned entry's bytes. False if the medium failed or was corrupt."""

    def write_many(self, entries: Sequence[Entry], srcs: Sequence[np.ndarray]) -> list[bool]:
        return [self.write(e, s) for e, s in zip(entries, srcs)]

    def read_many(self, entries: Sequence[Entry], outs: Sequence[np.ndarray]) -> list[bool]:
        return [self.read(e, o) for e, o in zip(entries, outs)]

    def view(self, entry: Entry) -> np.ndarray:
        """An addressable tier's block, in place (``block_bytes``)."""
        raise TypeError(f"the {self.name} tier has no slots to view")

    def slot_view(self, entry: Entry) -> np.ndarray:
        """An addressable tier's whole slot (padded, page aligned: written to files in place)."""
        raise TypeError(f"the {self.name} tier has no slots to view")

    # -- KV events (kvstore.store.events) -----------------------------------------------------------
    def journal_on(self) -> list[bytes]:
        """Start journaling what becomes servable here and what leaves; returns the keys it holds
        now (announced by the first take). A shared tier vouches for none: what this engine
        wrote there and what a read found gone are all it sees."""
        return []

    def journal_take(self) -> list[tuple[bool, bytes]]:
        """``(True, key)`` for a block that became servable, ``(False, key)`` for one that left,
        in order, since the last take."""
        return []

    def held_keys(self) -> list[bytes]:
        """Every servable key it holds (a shared tier: none it can vouch for)."""
        return []

    def state_of(self, key: bytes) -> int | None:
        """A local tier's entry state for ``key`` (READY, WRITING), or None: not indexed here."""
        return None

    def due(self, now: float) -> bool:
        """Is a block past its TTL here (a sweep would remove it)?"""
        return False

    def keep_meta(self, body_of) -> dict[bytes, bytes]:
        """A medium that keeps each block's event metadata itself (NVMe's files, so a restart
        announces them) takes ``body_of(key)``, and returns the bodies its start-up scan found
        (given once). Others: {}."""
        return {}

    # -- accounting --------------------------------------------------------------------------------
    ttl: float | None = None  # idle TTL of its blocks (None: no expiry)
    stats: dict
    corrupt_reasons: dict  # bad data found, by reason (the metrics sink reads it)
    up: bool = True  # answering (kvstore_remote_up for a shared tier)

    def error_counts(self) -> dict[str, int]:
        """Failed operations by op (``kvstore_tier_errors_total``), counted by the tier itself."""
        return {}

    def resident_bytes(self) -> int:
        """Bytes of an addressable tier resident in RAM."""
        return 0

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the tier has its configured capacity (the DRAM pool is prepared in the background)."""
        return True

    @property
    def used_bytes(self) -> int:
        return 0

    @property
    def capacity_bytes(self) -> int:
        return 0

    def __len__(self) -> int:
        return 0

    def close(self) -> None:
        pass
