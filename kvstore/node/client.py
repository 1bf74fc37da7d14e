"""An engine's store when it runs in node mode (``mode: node``): the host's ``kvstore serve``.

:class:`NodeStore` answers the calls the connector's two halves make of a store (lookups, pins,
reads, reservations and their ends: what :class:`~kvstore.offload.client.LocalClient` and
:class:`~kvstore.offload.mover.Mover` call on a :class:`~kvstore.store.KVStore`), over the
daemon's socket; the bytes move between the engine's KV cache and the daemon's DRAM slab, which
this process maps (:class:`~kvstore.node.slab.SharedSlab`), never through the socket.

Each calling thread keeps a connection of its own (the scheduler's lookups never wait behind the
load thread's NVMe read), all joined to one attachment in the daemon, which owns this engine's
handles. Every call ends within ``node.timeout_ms``. A failure (the daemon dead, stuck or
restarting) closes every connection, which makes the daemon release what this engine held, and
starts a backoff (0.5 s doubling to 30 s) during which calls fail at once without touching the
socket: lookups raise :class:`NodeUnavailable` (the planner's miss, reason ``store_error``),
stores are skipped (``kvstore_tier_skipped_blocks_total{reason="node_down"}``), reads of handles
from before the failure read nothing. One warning when the daemon is lost, one line when it is
back: the next call attaches again, to a new slab, and handles of the old one are refused.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvstore.config import StoreConfig
from kvstore.keys import ModelFingerprint, root_of
from kvstore.node import wire
from kvstore.node.daemon import socket_name
from kvstore.node.slab import SharedSlab
from kvstore.offload.sockdir import SocketTrustError, open_folder, path_in, peer_uid, who
from kvstore.store.cost import Rates
from kvstore.store.handles import PrefixMatch, check_keys, check_ttl
from kvstore.store.metrics import StoreMetrics

log = logging.getLogger(__name__)

BACKOFF_S = (0.5, 30.0)


class NodeUnavailable(ConnectionError):
    """The node daemon did not answer (or is in backoff): a miss, never an engine error."""


@dataclass
class NodeLoad:
    """A load pinned in the daemon (what the mover reads of a :class:`~kvstore.store.LoadHandle`)."""

    keys: list[bytes]
    num_blocks: int
    views: list[np.ndarray | None]
    tier_of: list[str]
    hid: int
    gen: int
    read: bool = False
    done: bool = False
    started: float = field(default_factory=time.perf_counter)


@dataclass
class NodeReservation:
    """Slots reserved in the daemon for a store (what the mover writes of a :class:`~kvstore.store.StoreHandle`)."""

    keys: list[bytes]
    views: list[np.ndarray | None]
    sid: int
    gen: int
    done: bool = False
    started: float = field(default_factory=time.perf_counter)


class _Link:
    def __init__(self, sock, gen: int):
        self.sock, self.gen = sock, gen


class NodeStore:
    def __init__(self, config: StoreConfig, *, block_bytes: int, fingerprint: ModelFingerprint,
                 block_tokens: int = 1, name: str = "", clock=time.monotonic):
        self.config = config
        self.block_bytes = int(block_bytes)
        self.block_tokens = int(block_tokens)
        self.fingerprint = fingerprint
        self.root = root_of(fingerprint)
        self.name = name
        self.timeout = config.node.timeout_ms / 1000
        self.metrics = StoreMetrics(port=config.metrics.port, host=config.metrics.host)  # this engine's counters
        self.rates = Rates(use=False)  # the daemon's store decides what is worth loading
        self.events = None  # the daemon's tiers are not announced on this engine's KV-event stream (yet)
        self.path = f"{config.node.name}.sock in this user's socket folder"
        self._clock = clock
        self._tls = threading.local()
        self._lock = threading.Lock()  # the attachment: token, slab, generation, links
        self._links: list[_Link] = []
        self._anchor = None  # the attachment's own connection (see _attach)
        self._token: bytes | None = None
        self._slab: SharedSlab | None = None
        self._gen = 0
        self._delay = 0.0
        self._down_until = float("-inf")
        self._lost = False  # the daemon was lost and not yet found again (one warning, one line)
        self._prefetch: ThreadPoolExecutor | None = None
        self._closed = False
        self.counts = {"attached": 0, "failures": 0, "stale_handles": 0}
        try:
            self._call("ping")
        except NodeUnavailable as e:
            log.warning("kvstore node: no daemon answers at %s yet (%s); this engine computes everything until one "
                        "does (start it with `kvstore serve --config ...`)", self.path, e)

    def __repr__(self) -> str:
        return f"<NodeStore {self.path} gen={self._gen}>"

    # -- the connection ----------------------------------------------------------------------------
    def _connect(self):
        fd, folder = open_folder()
        sock = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            sock.connect(path_in(fd, folder, socket_name(self.config.node.name)))
            uid = peer_uid(sock)
            if uid != os.getuid():
                raise SocketTrustError(f"kvstore node: the daemon's socket is served by {who(uid)}: refused")
            return sock
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        finally:
            os.close(fd)

    def _hello(self, sock, msg: list) -> dict:
        wire.send(sock, msg)
        ok, res = wire.recv(sock, time.monotonic() + self.timeout)
        if not ok:
            raise LookupError(res) if "unknown engine token" in str(res) else RuntimeError(res)
        return res

    def _attach(self) -> None:
        """Under the lock: a new attachment, anchored by a connection that makes no calls (so a
        call that times out never closes it: the daemon releases this engine's pins only when
        the engine closes, dies, or loses the daemon), the daemon's memfd mapped, a new generation."""
        sock = self._connect()
        try:
            fp = dataclasses.asdict(self.fingerprint)
            res = self._hello(sock, ["attach", fp, self.root, self.block_bytes, self.block_tokens, self.name])
            memfd = wire.recv_fd(sock)
            try:
                slab = SharedSlab(memfd, int(res["n_slots"]), int(res["slot_bytes"]))
            finally:
                os.close(memfd)  # the mapping keeps the memory
        except BaseException:
            sock.close()
            raise
        old, self._slab = self._slab, slab
        if old is not None:
            old.close()
        self._anchor = sock
        self._token, self._gen = bytes(res["token"]), self._gen + 1
        self.counts["attached"] += 1
        if self._lost:
            log.warning("kvstore node: attached again to the daemon at %s (pid %s)", self.path, res.get("pid"))
            self._lost = False

    def _link(self) -> _Link:
        link = getattr(self._tls, "link", None)
        if link is not None and link.gen == self._gen and link.sock is not None:
            return link
        with self._lock:
            if self._closed:
                raise NodeUnavailable("the store is closed")
            if self._clock() < self._down_until:
                raise NodeUnavailable("the daemon is unreachable (backoff)")
            try:
                if self._token is None:
                    self._attach()
                sock = self._connect()
                try:
                    self._hello(sock, ["join", self._token])
                except LookupError:  # the daemon restarted: a new attachment, a new slab
                    sock.close()
                    self._drop_all()
                    self._attach()
                    sock = self._connect()
                    self._hello(sock, ["join", self._token])
                except BaseException:
                    sock.close()
                    raise
                link = _Link(sock, self._gen)
                self._links.append(link)
            except (OSError, ValueError, RuntimeError, LookupError, SocketTrustError, KeyError, TypeError) as e:
                self._lose(e)
                raise NodeUnavailable(f"{type(e).__name__}: {e}") from None
        self._tls.link = link
        return link

    def _drop_all(self) -> None:
        """Under the lock: every connection closed, the anchor too (the daemon, if it lives,
        releases this engine's pins and reservations); every handle made before is refused."""
        for s in [link.sock for link in self._links] + [self._anchor]:
            try:
                if s is not None:
                    s.close()
            except OSError:
                pass
        for link in self._links:
            link.sock = None
        self._links.clear()
        self._anchor = None
        self._token = None
        self._gen += 1

    def _backoff(self) -> None:
        self._delay = BACKOFF_S[0] if self._delay == 0 else min(self._delay * 2, BACKOFF_S[1])
        self._down_until = self._clock() + self._delay

    def _lose(self, e: BaseException) -> None:
        """Under the lock: the daemon is gone (or refused us): drop everything, back off, and
        say so once until it is back."""
        self._drop_all()
        self.counts["failures"] += 1
        self._backoff()
        if not self._lost:
            self._lost = True
            log.warning("kvstore node: the daemon at %s failed (%s: %s); this engine computes what it would have "
                        "loaded, and attaches again when the daemon answers (backoff from %.1f s)", self.path,
                        type(e).__name__, e, self._delay)

    def _call(self, op: str, *args):
        link = self._link()
        try:
            wire.send(link.sock, [op, *args])
            ok, res = wire.recv(link.sock, time.monotonic() + self.timeout)
        except (TimeoutError, BlockingIOError):
            # stuck or slow: this connection's reply may still come, so it goes; the attachment
            # (its pins) stays with the anchor, and calls back off until the daemon answers again
            with self._lock:
                if link.sock is not None:
                    link.sock.close()
                    link.sock = None
                self.counts["failures"] += 1
                self._backoff()
            self._tls.link = None
            raise NodeUnavailable(f"{op}: no answer within {self.timeout:.3f} s") from None
        except (OSError, ValueError, AttributeError) as e:  # AttributeError: another thread dropped it
            with self._lock:
                if link.gen == self._gen:
                    self._lose(e)
            raise NodeUnavailable(f"{op}: {type(e).__name__}: {e}") from None
        self._delay = 0.0  # answered: the next failure backs off from the start
        if not ok:
            raise RuntimeError(f"kvstore node {op}: {res}")
        return res

    def _cast(self, op: str, *args) -> None:
        """A call whose answer is not waited for (``daemon.CASTS``)."""
        link = self._link()
        try:
            wire.send(link.sock, [op, *args])
        except (OSError, ValueError, AttributeError) as e:
            with self._lock:
                if link.gen == self._gen:
                    self._lose(e)
            raise NodeUnavailable(f"{op}: {type(e).__name__}: {e}") from None

    def _stale(self, gen: int) -> bool:
        if gen != self._gen:
            self.counts["stale_handles"] += 1
            return True
        return False

    def _views(self, slots: Sequence[int]) -> list[np.ndarray | None]:
        slab, bb = self._slab, self.block_bytes
        return [None if s < 0 else slab.view(s)[:bb] for s in slots]

    # -- lookups -----------------------------------------------------------------------------------
    def contains_prefix(self, keys: Sequence[bytes], *, record: bool = True, num_tokens: int | None = None,
                        held: int = 0) -> PrefixMatch:
        n, tiers, reason = self._call("lookup", check_keys(keys), record, num_tokens, held)
        return PrefixMatch(int(n), tuple(tiers), reason)

    def prefetch(self, keys: Sequence[bytes]) -> Future:
        keys = check_keys(keys)
        if self._prefetch is None:
            self._prefetch = ThreadPoolExecutor(1, "kvstore-node-prefetch")

        def job() -> int:
            token = self._call("prefetch", keys)
            while not self._call("prefetch_done", token):
                pass
            return 0

        return self._prefetch.submit(job)

    # -- loads -------------------------------------------------------------------------------------
    def pin_load(self, keys: Sequence[bytes], *, session: str | None = None, ttl_s: float | None = None) -> NodeLoad:
        keys = check_keys(keys)
        gen = self._gen
        hid, n, tier_of, slots = self._call("pin", keys, session, check_ttl(ttl_s))
        views = self._views(slots) if self._gen == gen else [None] * len(slots)
        h = NodeLoad(keys[:n], int(n), views, list(tier_of), hid, gen)
        h.read = all(v is not None for v in views)  # every block is in a slot already: nothing to read
        return h

    def read_load(self, h: NodeLoad, outs=None) -> int:
        """Have the daemon read the load's lower-tier blocks into slots (its NVMe and Redis reads);
        the leading blocks now in slots. A daemon lost since the pin: nothing."""
        if h.done:
            raise RuntimeError("read_load after end_load")
        if self._stale(h.gen):  # its pins went with the daemon (or this engine's attachment)
            h.read, h.num_blocks, h.views, h.tier_of = True, 0, [], []
            return 0
        if h.read:
            return h.num_blocks
        h.read = True
        try:
            n, slots = self._call("read", h.hid)
        except (NodeUnavailable, RuntimeError) as e:
            log.debug("kvstore node: read failed: %s", e)
            n, slots = 0, []
        n = min(int(n), h.num_blocks)
        views = self._views(slots[:n]) if not self._stale(h.gen) else []
        h.num_blocks, h.views, h.tier_of = len(views), views, h.tier_of[:len(views)]
        return h.num_blocks

    def end_load(self, h: NodeLoad) -> bool:
        """Unpin; False if the pins may have gone while the engine copied (the attachment was
        lost since the pin: another engine may have written those slots), so the caller fails
        the load instead of serving what it copied."""
        if h.done:
            raise RuntimeError("end_load called twice for one handle")
        h.done = True
        if self._stale(h.gen):
            return False
        # not waited for (the daemon answers nothing): while this engine's attachment lives, its
        # pins held, whatever the daemon does with the message; and a lost attachment shows here
        try:
            self._cast("end_load!", h.hid)
        except NodeUnavailable as e:  # unpinned with the attachment's end
            log.debug("kvstore node: end_load failed: %s", e)
        return not self._stale(h.gen)

    # -- stores ------------------------------------------------------------------------------------
    def begin_store(self, keys: Sequence[bytes], *, ttl_s: float | None = None) -> NodeReservation:
        keys = check_keys(keys)
        gen = self._gen
        try:
            sid, slots = self._call("begin_store", keys, check_ttl(ttl_s))
        except NodeUnavailable:
            self.metrics.skipped.labels("dram", "node_down").inc(len(keys))
            return NodeReservation(keys, [None] * len(keys), 0, gen)
        if self._gen != gen:  # lost meanwhile: the slots are another slab's
            return NodeReservation(keys, [None] * len(keys), 0, gen)
        return NodeReservation(keys, self._views(slots) + [None] * (len(keys) - len(slots)), sid, gen)

    def end_store(self, h: NodeReservation, ok: bool | Sequence[bool] = True) -> int:
        if h.done:
            raise RuntimeError("end_store called twice for one handle")
        h.done = True
        if not h.sid or self._stale(h.gen):
            return 0
        oks = [bool(ok)] * len(h.keys) if isinstance(ok, (bool, np.bool_)) else [bool(o) for o in ok]
        try:
            return int(self._call("end_store", h.sid, oks))
        except (NodeUnavailable, RuntimeError) as e:  # never published: the daemon aborts it with the connection
            log.debug("kvstore node: end_store failed: %s", e)
            return 0

    # -- the rest of a store's face ------------------------------------------------------------------
    def take_events(self) -> list:
        return []

    def update_gauges(self) -> None:
        """Nothing to bring up to date here: the daemon's gauges are its own."""

    def stats(self) -> dict:
        try:
            return self._call("stats")
        except (NodeUnavailable, RuntimeError) as e:
            return {"tiers": {}, "error": str(e)}

    def flush(self) -> None:
        """Background work is the daemon's."""

    def wait_ready(self, timeout: float | None = None) -> bool:
        return True

    def close(self, persist: bool = True) -> None:
        """Detach: the daemon ends whatever this engine still held; the daemon's store stays."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_all()
            slab, self._slab = self._slab, None
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=False, cancel_futures=True)
        if slab is not None:
            slab.close()
        self.metrics.close()
