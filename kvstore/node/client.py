"""An engine's store when it runs in node mode (``mode: node``): the host's ``kvstore serve``.

:class:`NodeStore` answers the calls the connector's two halves make of a store (lookups, pins,
reads, reservations and their ends: what :class:`~kvstore.offload.client.LocalClient` and
:class:`~kvstore.offload.runner.StepRunner` call on a :class:`~kvstore.store.KVStore`), over the
daemon's socket; the bytes move between the engine's KV cache and the daemon's DRAM slab, which
this process maps (:class:`~kvstore.node.slab.SharedSlab`), never through the socket.

**Connections.** The attachment is anchored by a connection that makes no call: the daemon ends
this engine's pins and reservations only when the anchor closes, and the anchor is closed only
when the engine closes or the daemon is gone (the anchor hung up, or a join says the daemon does
not know this engine: it restarted). Slots this engine holds are therefore never handed to
another engine while it may still write or read them. Each calling thread keeps a connection of
its own, joined to the attachment (the scheduler's lookups never wait behind the load thread's
NVMe read); one of a thread that ended is closed when the next is made.

**Failures.** Every call ends within ``node.timeout_ms``. A call that fails (no answer in time, a
closed connection), or a call not waited for that could not be sent whole, closes its own
connection (counted by op, ``kvstore_engine_node_failed_calls_total``: a frame half sent would make
the daemon read the next one from its middle) and starts a backoff (0.5 s doubling to 30 s) during
which calls fail at once, without the socket: lookups raise :class:`NodeUnavailable` (the
planner's miss, reason ``store_error``), stores are skipped
(``kvstore_tier_skipped_blocks_total{reason="node_down"}``), reads read nothing. Handle ids are
chosen here, so a pin or a reservation whose answer never came, or whose end could not be sent,
is ended later: its end waits in a queue sent on the next working connection (none is left held
in the daemon by a timeout). A daemon that is gone is said once, and its return once: the next
call attaches again to its new slab; handles of the old one read nothing, and a load copied out
of it is failed (``end_load`` answers False), never served. The old slab stays mapped until its
last handle ends (a copy in flight never meets an unmapped or unregistered buffer).

**KV events** (``events``: vLLM publishes them). The engine's names of the blocks it stores go
with their reservation, and :meth:`take_events` reads the daemon's records for this engine
(:mod:`.eventlog`): on attach every block the daemon holds, then what is stored and removed, by
any engine. So each engine announces on its own stream the daemon's blocks it can load. The
reads run on a thread of their own (:class:`_EventReads`, with its own connection), so a slow one
costs the engine's step at most ``node.timeout_ms`` once, never a backoff of the other calls.

**Reports.** The engine's own counters go to the daemon from a thread of their own
(:class:`_Reports`), within ``REPORT_S`` of a change and again when the store closes: not from the
lookup path, and not only at the close, which a killed engine never reaches.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import socket
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from prometheus_client import Counter

from kvstore.config import StoreConfig
from kvstore.keys import ModelFingerprint, root_of
from kvstore.node import wire
from kvstore.node.attachment import new_id
from kvstore.node.daemon import socket_name
from kvstore.node.eventlog import decode, meta_cap
from kvstore.node.metrics import MAX_SAMPLES, REPORT_S
from kvstore.node.slab import SharedSlab
from kvstore.offload.sockdir import SocketTrustError, open_folder, path_in, peer_uid, who
from kvstore.store.cost import Rates
from kvstore.store.events import BlockMeta
from kvstore.store.handles import PrefixMatch, check_keys, check_ttl
from kvstore.store.metrics import StoreMetrics
from kvstore.tiers.registry import top

log = logging.getLogger(__name__)

BACKOFF_S = (0.5, 30.0)
MAX_PENDING = 1 << 16  # ends of handles waiting for a working connection (one per handle at most)
# how long the events thread waits for its reply (the engine's step waits node.timeout_ms at most):
# a reply that comes late is still read, not lost; one that never comes is asked for again
EVENTS_DEADLINE_S = 30.0


class _Names:
    """The engine's names of the blocks it is about to store (the mover's ``events.remember``),
    until their reservation takes them to the daemon; the oldest go past MAX_PENDING. A name
    longer than the daemon takes (``eventlog.meta_cap``) is dropped, counted: its block is stored,
    never announced."""

    def __init__(self, cap: int) -> None:
        self._meta: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self.cap = cap
        self.too_long = 0

    def remember(self, keys: Sequence[bytes], metas: Sequence[BlockMeta | None]) -> None:
        with self._lock:
            for k, m in zip(keys, metas):
                if m is not None:
                    self._meta.pop(k, None)
                    body = m.encode()
                    if len(body) <= self.cap:
                        self._meta[k] = body
                    else:
                        self.too_long += 1
            for k in list(self._meta)[:max(0, len(self._meta) - MAX_PENDING)]:
                del self._meta[k]

    def take(self, keys: Sequence[bytes]) -> list[bytes | None] | None:
        with self._lock:
            out = [self._meta.pop(k, None) for k in keys]
        return out if any(m is not None for m in out) else None


class _EventReads:
    """The daemon's KV-event records for this engine, read on a thread of its own (its own
    connection, so its timeout never closes another thread's). A read is started by a take and
    waited for by it at most ``wait_s``; a read still out when the next take comes is not waited
    for again, and its records come with a later take. What waits here is at most one reply
    (eventlog.READ_LIMIT records, READ_BYTES of names): a read starts only when one is taken."""

    def __init__(self, store: "NodeStore") -> None:
        self.store = store
        self.lock = threading.Lock()
        self.got: list = []  # read, not taken yet
        self.out = False  # a read is out
        self.again = False  # the last read's reply never came (it may have been read there): ask for it again
        self.wake, self.done = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None

    def take(self, wait_s: float) -> list:
        with self.lock:
            start = not self.out
            if start:
                self.out = True
                self.done.clear()
                if self.thread is None:
                    self.thread = threading.Thread(target=self._run, name="kvstore-node-events", daemon=True)
                    self.thread.start()
                self.wake.set()
        if start:
            self.done.wait(wait_s)
        with self.lock:
            out, self.got = self.got, []
        return out

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            if self.store._closed:
                return
            try:
                recs = decode(self.store._call("events", self.again, timeout=EVENTS_DEADLINE_S, backoff=False)[0])
                self.again = False
            except (NodeUnavailable, RuntimeError) as e:
                log.debug("kvstore node: events: %s", e)
                recs, self.again = [], self.again or getattr(e, "sent", False)
            with self.lock:
                self.got.extend(recs)
                self.out = False
            self.done.set()


class NodeUnavailable(ConnectionError):
    """The node daemon did not answer (or is in backoff): a miss, never an engine error.
    ``sent``: the request may have reached the daemon (so what it made must be ended)."""

    def __init__(self, msg: str, sent: bool = False):
        super().__init__(msg)
        self.sent = sent


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
        self.thread = weakref.ref(threading.current_thread())  # closed once its thread is gone


_RDHUP = getattr(select, "POLLRDHUP", 0x2000)


def _alive(sock) -> bool:
    """The daemon has not closed this silent connection: no hang-up, no end of stream."""
    if sock is None:
        return False
    try:
        p = select.poll()
        p.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR | _RDHUP)
        for _fd, ev in p.poll(0):
            if ev & (select.POLLHUP | select.POLLERR | _RDHUP):
                return False
            if ev & select.POLLIN:
                return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except (OSError, ValueError):
        return False
    return True


class _Reports:
    """This engine's counters (``kvstore_engine_*_total``, the connector's) sent to the daemon on a
    thread of its own (its own connection), at most every ``REPORT_S`` and only when they changed,
    as a cast (not waited for; dropped while the daemon is away). Not from the close alone: vLLM
    kills an engine core that takes more than 5 s to stop (vllm.v1.utils.shutdown), and a loaded
    2-core CI machine's engine lost its figures so (stop 53: the host's prompt tokens half
    counted). Started by the first lookup; one thread per engine."""

    def __init__(self, store: "NodeStore") -> None:
        self.store = store
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.sent: list | None = None  # the samples last sent whole

    def start(self) -> None:
        if self.thread is None:
            with self.lock:
                if self.thread is None and not self.stop.is_set():
                    self.thread = threading.Thread(target=self._run, name="kvstore-node-reports", daemon=True)
                    self.thread.start()

    def samples(self) -> list:
        return [[x.name, dict(x.labels), x.value] for fam in self.store.metrics.registry.collect()
                for x in fam.samples if x.name.startswith("kvstore_engine_") and x.name.endswith("_total")]

    def send(self, samples: list | None = None) -> bool:
        """Cast the counters now on this thread's connection: False if they did not go."""
        samples = self.samples() if samples is None else samples
        if not samples:
            return False
        try:
            ok = self.store._cast(self.store._link(), ["report!", samples[:MAX_SAMPLES]])
        except NodeUnavailable:
            return False
        if ok:
            self.sent = samples
        return ok

    def _run(self) -> None:
        while not self.stop.wait(REPORT_S):
            samples = self.samples()
            if samples != self.sent:
                self.send(samples)

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            t = self.thread
        if t is not None and t is not threading.current_thread():
            t.join(self.store.timeout + 1)  # a send gives up within the store's timeout


class NodeStore:
    def __init__(self, config: StoreConfig, *, block_bytes: int, fingerprint: ModelFingerprint,
                 block_tokens: int = 1, name: str = "", events: bool = False, clock=time.monotonic):
        self.config = config
        self.block_bytes = int(block_bytes)
        self.block_tokens = int(block_tokens)
        self.fingerprint = fingerprint
        self.root = root_of(fingerprint)
        self.name = name
        self.timeout = config.node.timeout_ms / 1000
        self.metrics = StoreMetrics(port=config.metrics.port, host=config.metrics.host)  # this engine's counters
        # reported to the daemon with the engine's other counters (kvstore.node.metrics)
        self.failed_calls = Counter("kvstore_engine_node_failed_calls", "Calls to the node daemon that failed, by "
                                    "op: no answer in time, a connection that could not be made or was closed, a "
                                    "frame not sent whole", ["op"], registry=self.metrics.registry)
        self.rates = Rates(use=False)  # the daemon's store decides what is worth loading
        self.events = _Names(meta_cap(self.block_tokens)) if events else None  # on this engine's KV-event stream
        self._reads = _EventReads(self)
        self.path = f"{config.node.name}.sock in this user's socket folder"
        self._clock = clock
        self._tls = threading.local()
        self._lock = threading.Lock()  # the attachment: anchor, token, slab, generation, links, queue
        self._links: list[_Link] = []
        self._anchor = None
        self._token: bytes | None = None
        self._slab: SharedSlab | None = None
        self._gen = 0
        self._open: dict[int, int] = {}  # generation -> its handles not yet ended
        self._retired: dict[int, SharedSlab] = {}  # slabs of lost daemons, until their last handle ends
        self._pending: list[tuple[int, list]] = []  # (generation, a handle's end) to send when we can
        self._delay = 0.0
        self._down_until = float("-inf")
        self._lost = False  # the daemon was lost and not yet found again (one warning, one line)
        self._prefetch_lock = threading.Lock()
        self._prefetch: ThreadPoolExecutor | None = None
        self._closed = False
        self._reports = _Reports(self)
        self.counts = {"attached": 0, "failures": 0, "stale_handles": 0, "pending_dropped": 0}
        try:
            self._call("ping")
        except NodeUnavailable:  # said once by _failed; the engine computes until a daemon answers
            pass

    def __repr__(self) -> str:
        return f"<NodeStore {self.path} gen={self._gen}>"

    # -- connections (under the lock) -----------------------------------------------------------------
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
        """A new attachment: its anchor, the daemon's memfd mapped, a new generation."""
        sock = self._connect()
        try:
            fp = dataclasses.asdict(self.fingerprint)
            res = self._hello(sock, ["attach", fp, self.root, self.block_bytes, self.block_tokens, self.name])
            memfd = wire.recv_fd(sock)
            try:
                slab = SharedSlab(memfd, int(res["n_slots"]), int(res["slot_bytes"]),
                                  populate=res.get("populate", True) is True)
            finally:
                os.close(memfd)  # the mapping keeps the memory
        except BaseException:
            sock.close()
            raise
        self._slab, self._anchor = slab, sock
        self._token, self._gen = bytes(res["token"]), self._gen + 1
        self.counts["attached"] += 1
        if self._lost:
            log.warning("kvstore node: attached again to the daemon at %s (pid %s)", self.path, res.get("pid"))
            self._lost = False

    def _detach(self) -> None:
        """Every connection closed, the anchor last; the slab retired until its handles end."""
        for link in self._links:
            if link.sock is not None:
                link.sock.close()
                link.sock = None
        self._links.clear()
        if self._anchor is not None:
            self._anchor.close()
        self._anchor, self._token = None, None
        if self._slab is not None:
            self._retired[self._gen] = self._slab
            self._slab = None
            self._retire(self._gen)
        self._pending = [p for p in self._pending if p[0] == self._gen + 1]  # the old daemon's ends: moot
        self._gen += 1

    def _retire(self, gen: int) -> None:
        if not self._open.get(gen) and gen in self._retired:
            self._retired.pop(gen).close()
            self._open.pop(gen, None)

    def _backoff(self) -> None:
        self._delay = BACKOFF_S[0] if self._delay == 0 else min(self._delay * 2, BACKOFF_S[1])
        self._down_until = self._clock() + self._delay
        self.counts["failures"] += 1

    def _failed(self, e: BaseException) -> None:
        """A call or a join failed: back off; if the daemon is gone (its anchor hung up), detach."""
        self._backoff()
        if _alive(self._anchor):
            return  # slow, stuck, or refusing one more connection: this engine keeps what it holds
        gone = self._anchor is not None or self._token is None
        self._detach()
        if gone and not self._lost:
            self._lost = True
            log.warning("kvstore node: no daemon answers at %s (%s: %s); this engine computes what it would "
                        "have loaded, and attaches when one answers (backoff from %.1f s; start it with `kvstore "
                        "serve --config ...`)", self.path, type(e).__name__, e, self._delay)

    def _prune(self) -> None:
        keep = []
        for link in self._links:
            t = link.thread()
            if link.sock is not None and t is not None and t.is_alive():
                keep.append(link)
            elif link.sock is not None:
                link.sock.close()
                link.sock = None
        self._links = keep

    def _link(self) -> _Link:
        link = getattr(self._tls, "link", None)
        if link is not None and link.gen == self._gen and link.sock is not None:
            return link
        with self._lock:
            if self._closed:
                raise NodeUnavailable("the store is closed")
            if self._clock() < self._down_until:
                raise NodeUnavailable("the daemon is unreachable (backoff)")
            self._prune()
            sock = None
            try:
                if self._token is None:
                    self._attach()
                sock = self._connect()
                try:
                    self._hello(sock, ["join", self._token])
                except LookupError:  # the daemon restarted: its predecessor, and our pins, are gone
                    sock.close()
                    self._detach()
                    self._attach()
                    sock = self._connect()
                    self._hello(sock, ["join", self._token])
                link = _Link(sock, self._gen)
                self._flush(link)
            except (OSError, ValueError, RuntimeError, LookupError, SocketTrustError, KeyError, TypeError) as e:
                if sock is not None:
                    sock.close()
                self._failed(e)
                self.failed_calls.labels("join").inc()
                raise NodeUnavailable(f"{type(e).__name__}: {e}") from None
            self._links.append(link)
        self._tls.link = link
        return link

    def _flush(self, link: _Link) -> None:
        """Send the queued ends of handles of this generation on a new connection."""
        todo = [m for g, m in self._pending if g == link.gen]
        self._pending = [p for p in self._pending if p[0] != link.gen]
        for m in todo:
            wire.send(link.sock, m)

    def _queue(self, gen: int, msg: list) -> None:
        with self._lock:
            if gen != self._gen:
                return  # that daemon is gone: it ended everything
            if len(self._pending) >= MAX_PENDING:
                self._pending.pop(0)
                self.counts["pending_dropped"] += 1
            self._pending.append((gen, msg))

    def _drop(self, link: _Link, op: str, e: BaseException, backoff: bool = True) -> None:
        """A call on ``link`` failed: the connection goes (an answer may still come on it, or the
        daemon may be reading a frame of it half sent), counted by op; ``backoff``: and the daemon
        is backed off (it did not answer in time, or is gone), the attachment kept while it lives."""
        with self._lock:
            if link.sock is not None:
                link.sock.close()
                link.sock = None
            if backoff and link.gen == self._gen:
                self._failed(e)
        self._tls.link = None
        self.failed_calls.labels(op.rstrip("!")).inc()

    def _call(self, op: str, *args, timeout: float | None = None, backoff: bool = True) -> tuple:
        """(the answer, the generation it came from), within ``timeout`` (node.timeout_ms);
        ``backoff``: a failure backs the daemon off for every call (not for the events thread's
        reads: a slow one says nothing of the daemon's other answers)."""
        t = self.timeout if timeout is None else timeout
        link = self._link()
        sent = False
        try:
            if link.sock.gettimeout() != t:  # lowered near a past call's deadline
                link.sock.settimeout(t)
            wire.send(link.sock, [op, *args])
            sent = True
            ok, res = wire.recv(link.sock, time.monotonic() + t)
        except (OSError, ValueError, AttributeError) as e:  # AttributeError: another thread closed it
            self._drop(link, op, e, backoff)  # this connection's answer may still come: it goes, the attachment stays
            what = f"no answer within {t:.3f} s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            raise NodeUnavailable(f"{op}: {what}", sent=sent or isinstance(e, TimeoutError)) from None
        self._delay = 0.0  # answered: the next failure backs off from the start
        if not ok:
            raise RuntimeError(f"kvstore node {op}: {res}")
        return res, link.gen

    def _cast(self, link: _Link, msg: list) -> bool:
        """Send ``msg`` on this thread's ``link``, not waited for (``daemon.CASTS``): False if it
        did not go whole (the connection closed then: the daemon drops a frame cut short)."""
        try:
            if link.sock.gettimeout() != self.timeout:
                link.sock.settimeout(self.timeout)
            wire.send(link.sock, msg)
            return True
        except (OSError, AttributeError) as e:  # AttributeError: another thread closed it
            self._drop(link, msg[0], e)
            return False

    def _end(self, gen: int, msg: list) -> None:
        """Send a handle's end, not waited for (``daemon.CASTS``); queued when it cannot go now."""
        try:
            link = self._link()
            if link.gen != gen:
                return  # that daemon is gone: it ended everything
            if self._cast(link, msg):
                return
        except NodeUnavailable:
            pass
        self._queue(gen, msg)

    def _opened(self, gen: int) -> None:
        with self._lock:
            self._open[gen] = self._open.get(gen, 0) + 1

    def _ended(self, gen: int) -> None:
        with self._lock:
            self._open[gen] = self._open.get(gen, 1) - 1
            self._retire(gen)

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
        self._report()
        (n, tiers, reason), _ = self._call("lookup", check_keys(keys), record, num_tokens, held)
        return PrefixMatch(int(n), tuple(tiers), reason)

    def _report(self, force: bool = False) -> None:
        """This engine's own counters (kvstore_engine_*, the connector's) to the daemon, which
        exports them per engine and for the host (kvstore.node.metrics): ``force``, sent now on
        this thread's connection; else the reports' thread is started (:class:`_Reports`)."""
        if force:
            self._reports.send()
        else:
            self._reports.start()

    def prefetch(self, keys: Sequence[bytes]) -> Future:
        keys = check_keys(keys)
        with self._prefetch_lock:
            if self._prefetch is None:
                self._prefetch = ThreadPoolExecutor(1, "kvstore-node-prefetch")

        def job() -> int:
            token, _ = self._call("prefetch", keys)
            while not self._call("prefetch_done", token)[0]:
                pass
            return 0

        return self._prefetch.submit(job)

    # -- loads -------------------------------------------------------------------------------------
    def pin_load(self, keys: Sequence[bytes], *, session: str | None = None, ttl_s: float | None = None) -> NodeLoad:
        keys, hid, gen = check_keys(keys), new_id(), self._gen
        try:
            (n, tier_of, slots), gen = self._call("pin", hid, keys, session, check_ttl(ttl_s))
        except NodeUnavailable as e:
            if e.sent:  # it may be pinned there: ended once a connection works
                self._queue(gen, ["end_load!", hid])
            raise
        self._opened(gen)
        with self._lock:
            views = self._views(slots) if self._gen == gen and self._slab is not None else [None] * len(slots)
        h = NodeLoad(keys[:n], int(n), views, list(tier_of), hid, gen)
        h.read = all(v is not None for v in views)  # every block is in a slot already: nothing to read
        return h

    def read_load(self, h: NodeLoad, outs=None) -> int:
        """Have the daemon read the load's lower-tier blocks into slots (its NVMe and Redis reads);
        the leading blocks now in slots. A daemon lost since the pin: nothing."""
        if h.done:
            raise RuntimeError("read_load after end_load")
        if self._stale(h.gen):  # its pins went with the daemon
            h.read, h.num_blocks, h.views, h.tier_of = True, 0, [], []
            return 0
        if h.read:
            return h.num_blocks
        h.read = True
        try:
            (n, slots), gen = self._call("read", h.hid)
        except (NodeUnavailable, RuntimeError) as e:
            log.debug("kvstore node: read failed: %s", e)
            n, slots, gen = 0, [], h.gen
        n = min(int(n), h.num_blocks)
        with self._lock:
            views = self._views(slots[:n]) if gen == h.gen == self._gen and self._slab is not None else []
        h.num_blocks, h.views, h.tier_of = len(views), views, h.tier_of[:len(views)]
        return h.num_blocks

    def end_load(self, h: NodeLoad) -> bool:
        """Unpin; False if the pins may have gone while the engine copied (the daemon was lost since
        the pin: what was copied is not served, the caller fails the load)."""
        if h.done:
            raise RuntimeError("end_load called twice for one handle")
        h.done = True
        try:
            if self._stale(h.gen):
                return False
            self._end(h.gen, ["end_load!", h.hid])  # not waited for: the attachment keeps the pins meanwhile
            return not self._stale(h.gen)
        finally:
            self._ended(h.gen)
            self._report()

    # -- stores ------------------------------------------------------------------------------------
    def begin_store(self, keys: Sequence[bytes], *, ttl_s: float | None = None) -> NodeReservation:
        keys, sid, gen = check_keys(keys), new_id(), self._gen
        try:
            metas = self.events.take(keys) if self.events is not None else None
            slots, gen = self._call("begin_store", sid, keys, check_ttl(ttl_s), metas)
        except (NodeUnavailable, RuntimeError) as e:
            if getattr(e, "sent", False):  # it may be reserved there: aborted once a connection works
                self._queue(gen, ["end_store!", sid, []])
            self.metrics.skipped.labels(top(), "node_down").inc(len(keys))
            return NodeReservation(keys, [None] * len(keys), 0, gen)
        self._opened(gen)
        with self._lock:
            views = self._views(slots) if self._gen == gen and self._slab is not None else [None] * len(slots)
        return NodeReservation(keys, views + [None] * (len(keys) - len(views)), sid, gen)

    def end_store(self, h: NodeReservation, ok: bool | Sequence[bool] = True) -> int:
        """Publish what was written (``ok`` may be per key); the blocks stored. Never waits past
        the timeout: an end that is not answered is queued as an abort (if the publish reached the
        daemon first it stands, the abort finds nothing)."""
        if h.done:
            raise RuntimeError("end_store called twice for one handle")
        h.done = True
        if not h.sid:
            return 0
        try:
            if self._stale(h.gen):
                return 0
            oks = [bool(ok)] * len(h.keys) if isinstance(ok, (bool, np.bool_)) else [bool(o) for o in ok]
            try:
                n, _ = self._call("end_store", h.sid, oks)
                return int(n)
            except (NodeUnavailable, RuntimeError) as e:
                log.debug("kvstore node: end_store failed: %s", e)
                self._queue(h.gen, ["end_store!", h.sid, []])
                return 0
        finally:
            self._ended(h.gen)

    # -- the rest of a store's face ------------------------------------------------------------------
    def take_events(self) -> list:
        """(stored, tier, BlockMeta) of the daemon's blocks since the last call ([] with events off
        or without a daemon): what the events thread read, waited for at most node.timeout_ms
        (:class:`_EventReads`)."""
        if self.events is None or self._closed:
            return []
        return self._reads.take(self.timeout)

    def update_gauges(self) -> None:
        """Nothing to bring up to date here: the daemon's gauges are its own."""

    def stats(self) -> dict:
        try:
            return self._call("stats")[0]
        except (NodeUnavailable, RuntimeError) as e:
            return {"tiers": {}, "error": str(e)}

    def flush(self) -> None:
        """Background work is the daemon's."""

    def wait_ready(self, timeout: float | None = None) -> bool:
        return True

    def close(self, persist: bool = True) -> None:
        """Detach: the daemon ends whatever this engine still held; the daemon's store stays."""
        if not self._closed:
            self._reports.close()
            self._report(force=True)  # its last figures, which the daemon keeps under its name
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reads.wake.set()  # its thread ends
            self._detach()
            retired, self._retired = list(self._retired.values()), {}
        with self._prefetch_lock:
            if self._prefetch is not None:
                self._prefetch.shutdown(wait=False, cancel_futures=True)
        for slab in retired:  # the connector closed its mover first: no copy is in flight
            slab.close()
        self.metrics.close()
