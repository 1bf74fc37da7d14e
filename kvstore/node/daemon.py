"""``kvstore serve``: one store per host, shared by every engine of the host (issue 46).

The daemon owns the tiers (the DRAM slab, NVMe, the Redis client), their sweeps and their
metrics: the same :class:`~kvstore.store.KVStore` an embedded engine runs, one per model (a model
is its fingerprint's root with its block size: engines of other models, revisions, dtypes,
layouts or tensor-parallel ranks get stores of their own, and never see each other's blocks).
``tiers.dram.capacity_gb`` is the host's budget across the models, one LRU over them (a rule in
:mod:`.budget` moves capacity, ``PERIOD_S``; ``node.model_quota_gb`` caps some models). Each
model's DRAM slab is one memfd (:func:`kvstore.tiers.dram.pool.shared_memory`) handed to each engine
over the socket (``SCM_RIGHTS``): the engine maps it and its copy kernels move bytes between its
own paged KV cache and the slots, so no block passes through the daemon. What crosses the socket
is control (:mod:`.wire`): lookups, pins, slot numbers, reservations and their ends.

The socket is ``<name>.sock`` in this user's private socket folder (:mod:`kvstore.offload.sockdir`:
0700, this uid, no links), served to this uid only (``SO_PEERCRED``). An engine that dies (-9
included) closes its connections, and :meth:`Attachment.release` ends its pins and aborts its
reservations. A graceful stop (SIGTERM, SIGINT) writes DRAM down to NVMe, where the next daemon
finds it by the tier's start-up scan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import socketserver
import threading
import time
from typing import Any

from kvstore.config import ConfigError, StoreConfig
from kvstore.keys import ModelFingerprint, root_of
from kvstore.node import budget, wire
from kvstore.node.attachment import Attachment
from kvstore.node.eventlog import DRAIN_S, EventLog, meta_cap
from kvstore.node.metrics import NodeMetrics, check_report
from kvstore.offload.frames import serve_timeouts
from kvstore.offload.private_server import PrivateServer
from kvstore.offload.sockdir import open_folder, path_in
from kvstore.store import KVStore
from kvstore.store.machine import check_dram
from kvstore.tiers.registry import top
from kvstore.store.events import BlockMeta
from kvstore.store.handles import check_keys, check_ttl

log = logging.getLogger(__name__)

# no idle limit: an engine's anchor connection makes no call for hours, and its close releases the
# engine's pins; the connections are bounded by node.max_engines instead
IDLE_S = math.inf
FRAME_S = 5.0  # the rest of a frame must come this soon after its first byte
CONNECTIONS_PER_ENGINE = 16  # an engine's anchor, scheduler, copy, load and RPC threads, with room to spare
MAX_STORES = 8  # models with a store here at once (one DRAM budget shared by them: kvstore.node.budget)
PREFETCH_WAIT_S = 0.002  # as LocalClient's: an idle engine asking again must not spin


def socket_name(name: str) -> str:
    return f"{name}.sock"


def fingerprint_of(d: Any) -> ModelFingerprint:
    """An engine's fingerprint from its attach message (lists back to tuples, as it hashed them)."""
    if not isinstance(d, dict):
        raise ValueError("attach: the fingerprint is not a mapping")

    def tup(v):
        return tuple(tup(x) for x in v) if isinstance(v, list) else v

    return ModelFingerprint(**{k: tup(v) for k, v in d.items()})


class NodeDaemon:
    """The stores, the engines attached to them, and the socket they are served on."""

    def __init__(self, config: StoreConfig):
        if not config.tiers.dram.enabled:
            raise ConfigError("tiers.dram.capacity_gb", config.tiers.dram.capacity_gb,
                              "more than 0 for a node daemon: its engines copy to and from its DRAM slab")
        check_dram(config)  # the budget of every model's DRAM (their stores do not check it again)
        self.config = config
        self.stores: dict[tuple, KVStore] = {}
        self._wanted: dict[int, int] = {}  # id(store) -> its index's ``wanted`` at the last rebalance
        self._trim: set[int] = set()  # id(store) of those whose limit fell: trimmed once their demotions end
        self.logs: dict[int, EventLog] = {}  # id(store) -> its KV-event records, read by its engines
        self.models: dict[int, str] = {}  # id(store) -> its model's name (metrics labels)
        self.engines: dict[bytes, Attachment] = {}
        self.lock = threading.Lock()
        self._making = threading.Lock()  # one store made at a time, outside self.lock
        self._balancing = threading.Lock()  # one rebalance at a time (the drain thread's, a test's)
        self.refused = {"uid": 0, "full": 0, "attach": 0}
        self._dir, folder = open_folder()
        self._name = socket_name(config.node.name)
        self.path = os.path.join(folder, self._name)
        self.metrics: NodeMetrics | None = None
        try:
            self._claim(folder)
            # the stores' own metrics are served here, with each engine's (kvstore.node.metrics)
            self.metrics = NodeMetrics(self, config.metrics.port, config.metrics.host)
            old = os.umask(0o177)
            try:
                self.server = PrivateServer(path_in(self._dir, folder, self._name), _Handler, self,
                                            config.node.max_engines * CONNECTIONS_PER_ENGINE, self.refused,
                                            "kvstore serve")
            finally:
                os.umask(old)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            os.close(self._dir)
            raise
        self.thread: threading.Thread | None = None
        self._closed = False
        self._stop = threading.Event()
        self._drainer: threading.Thread | None = None

    def _claim(self, folder: str) -> None:
        """Take the socket's name: a daemon that answers there keeps it (an error), a dead one's
        socket is removed."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(1.0)
            s.connect(path_in(self._dir, folder, self._name))
        except (FileNotFoundError, ConnectionRefusedError):
            try:
                os.unlink(self._name, dir_fd=self._dir)
            except FileNotFoundError:
                pass
            return
        finally:
            s.close()
        raise RuntimeError(f"kvstore serve: another daemon serves {self.path}; stop it, or give this one another "
                           f"node.name")

    def start(self) -> "NodeDaemon":
        self.thread = threading.Thread(target=self.server.serve_forever, name="kvstore-node", daemon=True)
        self.thread.start()
        self._drainer = threading.Thread(target=self._drain, name="kvstore-node-events", daemon=True)
        self._drainer.start()
        log.info("kvstore serve: ready on %s (DRAM %.2f GiB per model, NVMe %s, remote %s)", self.path,
                 self.config.tiers.dram.capacity_gb, self.config.tiers.nvme.path or "a temp folder",
                 "on" if self.config.tiers.remote.enabled else "off")
        return self

    def _drain(self) -> None:
        """Every store's KV-event journal into its log, whether or not an engine reads it (which
        runs the stores' TTL sweeps too)."""
        while not self._stop.wait(DRAIN_S):
            with self.lock:
                logs = list(self.logs.values())
            try:
                self.rebalance()
            except Exception as e:  # noqa: BLE001 - a store closing under it; the next round goes on
                log.debug("kvstore serve: moving DRAM between models: %s", e)
            for lg in logs:
                try:
                    lg.drain()
                except Exception as e:  # noqa: BLE001 - a store closing under it; the next round goes on
                    log.debug("kvstore serve: draining KV events: %s", e)

    # -- the DRAM budget ---------------------------------------------------------------------------
    def _quota(self, model: str) -> int | None:
        gb = (self.config.node.model_quota_gb or {}).get(model)
        return None if gb is None else int(gb * (1 << 30))

    def rebalance(self) -> list[int]:
        """One round of :func:`budget.rebalance`: each model's DRAM limit set, and a model left
        over its new limit swept (its least recent blocks written down) and trimmed (their
        memory given back). Returns the limits (the stores' order)."""
        with self._balancing:
            return self._rebalance()

    def _rebalance(self) -> list[int]:
        with self.lock:
            stores = list(self.stores.values())
        if len(stores) < 2 and not self.config.node.model_quota_gb:
            return [s.dram.limit_bytes for s in stores]  # one model: all of the budget, as made
        shares = []
        for s in stores:
            d = s.dram
            with d.lock:
                wanted = d.index.wanted - self._wanted.get(id(s), 0)
                self._wanted[id(s)] = d.index.wanted
                shares.append(budget.Share(limit=d.limit_bytes, used=d.index.used, wanted=wanted,
                                           oldest=d.index.oldest_access(), unit=d.slot_bytes,
                                           quota=self._quota(self.models[id(s)])))
        limits = budget.rebalance(shares, self.config.tiers.dram.capacity_bytes)
        for s, sh, lim in zip(stores, shares, limits):
            if id(s) in self._trim and not len(s.chain.demotions):  # its blocks past the limit left their
                s.dram.trim()  # slots (written down) since a round before: their memory goes back
                self._trim.discard(id(s))
            if lim == sh.limit:
                continue
            s.dram.limit(lim)
            if lim < sh.limit:  # what it holds past it is written down (in the store's background)
                s.sweep()
                self._trim.add(id(s))
        return limits

    # -- engines ---------------------------------------------------------------------------------
    def store_for(self, fp: ModelFingerprint, block_bytes: int, block_tokens: int) -> KVStore:
        """The store of a model, made at its first engine's attach: outside the daemon's lock (a
        store's start-up scans its NVMe folder; the engines' joins and ends must not wait for it),
        one at a time."""
        k = (root_of(fp), int(block_bytes), int(block_tokens))
        with self._making:
            with self.lock:
                s = self.stores.get(k)
                if s is not None:
                    return s
                if len(self.stores) >= MAX_STORES:
                    raise ValueError(f"{MAX_STORES} models have stores here already (sharing one DRAM budget, "
                                     f"tiers.dram.capacity_gb); stop this daemon to free them")
                # the budget left to a newcomer (the first model: all of it, pre-faulted); the rest of
                # its slab takes pages as the budget moves some to it (kvstore.node.budget)
                held = sum(x.dram.limit_bytes for x in self.stores.values())
            total, quota = self.config.tiers.dram.capacity_bytes, self._quota(str(fp.model))
            slab = total if quota is None else min(quota, total)
            first = min(slab, max(0, total - held))
            cfg = dataclasses.replace(self.config, metrics=dataclasses.replace(self.config.metrics, port=None),
                                      tiers=dataclasses.replace(self.config.tiers, dram=dataclasses.replace(
                                          self.config.tiers.dram, capacity_gb=slab / (1 << 30))))
            s = KVStore(cfg, block_bytes=block_bytes, fingerprint=fp, block_tokens=block_tokens,
                        events=True, check_memory=False,
                        tier_options={top(): {"shared": True, "prefault_bytes": first}})
            if s.dram is not None and first < slab:
                s.dram.limit(first)
            if s.dram is None:
                s.close(persist=False)
                raise ConfigError("tiers.dram.capacity_gb", self.config.tiers.dram.capacity_gb,
                                  f"room for at least one block of {block_bytes} bytes")
            with self.lock:
                self.stores[k] = s
                self.logs[id(s)] = EventLog(s)
                self.models[id(s)] = str(fp.model)
        log.info("kvstore serve: a store for %s (%d bytes a block, %d tokens)", fp.model, block_bytes, block_tokens)
        return s

    def attach(self, fp_fields: Any, root: bytes, block_bytes: int, block_tokens: int, name: str) -> Attachment:
        fp = fingerprint_of(fp_fields)
        if not isinstance(root, bytes) or root_of(fp) != root:
            raise ValueError("attach: the fingerprint does not hash to the engine's key root (another kvstore "
                             "version?): its keys would not be ours")
        if not (type(block_bytes) is int and type(block_tokens) is int and 0 < block_bytes <= 1 << 30
                and 0 < block_tokens <= 1 << 20):
            raise ValueError(f"attach: block of {block_bytes!r} bytes, {block_tokens!r} tokens")
        store = self.store_for(fp, block_bytes, block_tokens)
        a = Attachment(store, str(name)[:256], int(store.dram.pool.n_slots * self.config.node.engine_share),
                       self.logs[id(store)])
        with self.lock:
            if len(self.engines) >= self.config.node.max_engines:
                raise ValueError(f"{self.config.node.max_engines} engines are attached already (node.max_engines)")
            a.connections = 1  # this one: its close releases the engine
            self.engines[a.token] = a
        log.info("kvstore serve: engine %s attached (%d engines)", a.name, len(self.engines))
        return a

    def join(self, token: bytes) -> Attachment:
        """Another connection of an attached engine (counted: its close may release the engine)."""
        with self.lock:  # with the count, so a join never revives an engine its last close released
            a = self.engines.get(token) if isinstance(token, bytes) else None
            if a is None:
                raise LookupError("unknown engine token (this daemon restarted?): attach again")
            if a.connections >= CONNECTIONS_PER_ENGINE:
                raise ValueError(f"engine {a.name} has {CONNECTIONS_PER_ENGINE} connections open already")
            a.connections += 1
        return a

    def closed(self, a: Attachment) -> None:
        """A connection of ``a`` closed; the last one's close releases it."""
        with self.lock:
            a.connections -= 1
            last = a.connections == 0
            if last:
                self.engines.pop(a.token, None)
        if last:
            self.metrics.retire(a)
            loads, stores = a.release()
            log.info("kvstore serve: engine %s detached (%d loads ended, %d stores aborted)", a.name, loads, stores)

    # -- the end ---------------------------------------------------------------------------------
    def close(self, persist: bool = True) -> None:
        """Stop serving, release every engine, write DRAM down to NVMe (``persist``), close."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.server.stop(self._dir, self._name)
        os.close(self._dir)
        with self.lock:
            engines, self.engines = list(self.engines.values()), {}
            stores, self.stores = list(self.stores.values()), {}
            self.logs = {}
        if self._drainer is not None:
            self._drainer.join()
        self.metrics.close()
        for a in engines:
            a.release()
        for s in stores:
            t0 = time.monotonic()
            n = len(s.dram) if s.dram is not None else 0
            s.close(persist=persist)
            log.info("kvstore serve: closed a store (%d DRAM blocks, written down: %s) in %.1f s", n,
                     "yes" if persist else "no", time.monotonic() - t0)


# -- serving ---------------------------------------------------------------------------------------

# calls answered with nothing (the engine does not wait for them; the stream keeps their order):
# the end of a load, on the engine's forward path (one round trip less per hit: 0.1-0.3 ms here)
# and an engine's report of its counters (kvstore.node.metrics)
CASTS = {"end_load!": "end_load", "end_store!": "end_store", "report!": "report"}


def _slot(e) -> int:
    return -1 if e is None else int(e.slot)


MAX_KEYS = 1 << 16  # blocks a call may name (a 1M-token prompt of 16-token blocks)


def _keys(v) -> list[bytes]:
    if not isinstance(v, list) or len(v) > MAX_KEYS:
        raise ValueError(f"keys: a list of at most {MAX_KEYS} block keys")
    return check_keys(v)


def _session(v) -> str | None:
    if v is None or (isinstance(v, str) and 0 < len(v) <= 256):
        return v
    raise ValueError("session: a string of 1 to 256 characters, or null")


def _int(v, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
        raise ValueError(f"an integer >= {lo}, got {type(v).__name__}")
    return v


def _metas(v, n: int, cap: int) -> list:
    """The engine's names of the blocks it stores, for the KV events (None: none); each at most
    ``cap`` bytes (eventlog.meta_cap of the store's block: a name is kept per block held, and
    travels in every new reader's first pages)."""
    if v is None:
        return []
    if not isinstance(v, list) or len(v) != n or not all(m is None or (isinstance(m, bytes) and len(m) <= cap)
                                                       for m in v):
        raise ValueError(f"metas: null, or a list of {n} entries, each null or at most {cap} bytes")
    return [None if m is None else BlockMeta.decode(m) for m in v]


def _args(msg: list, n: int) -> list:
    if len(msg) != n + 1:
        raise ValueError(f"{msg[0]}: {n} arguments, got {len(msg) - 1}")
    return msg[1:]


def _serve(a: Attachment, msg: list, metrics: NodeMetrics | None = None) -> Any:
    """One call of an attached engine, its arguments checked first (a same-uid client may send
    anything); ``metrics`` counts the samples of its reports that are skipped."""
    op = msg[0]
    if op == "lookup":
        keys, record, num_tokens, held = _args(msg, 4)
        m = a.store.contains_prefix(_keys(keys), record=record is True,
                                    num_tokens=None if num_tokens is None else _int(num_tokens), held=_int(held))
        return [m.num_blocks, list(m.tiers), m.miss_reason]
    if op == "pin":
        hid, keys, session, ttl = _args(msg, 4)
        h = a.pin(hid, _keys(keys), _session(session), check_ttl(ttl))
        return [h.num_blocks, list(h.tier_of), [_slot(e) for e in h.entries]]
    if op == "read":
        return list(a.read(_args(msg, 1)[0]))
    if op == "end_load":
        return a.end_load(_args(msg, 1)[0])
    if op == "begin_store":
        sid, keys, ttl, metas = _args(msg, 4)
        keys, ttl = _keys(keys), check_ttl(ttl)
        metas = _metas(metas, len(keys), meta_cap(a.store.block_tokens))
        entries = a.begin_store(sid, keys, ttl)
        if metas and a.store.events is not None:  # the names of the blocks reserved (none is published before
            # their end_store, sent after this answer); one stored already keeps the name it has
            mine = [i for i, e in enumerate(entries) if e is not None and metas[i] is not None]
            a.store.events.remember([keys[i] for i in mine], [metas[i] for i in mine])
        return [_slot(e) for e in entries]
    if op == "end_store":
        sid, oks = _args(msg, 2)
        return a.end_store(sid, oks)
    if op == "prefetch":
        return a.prefetch(_keys(_args(msg, 1)[0]))
    if op == "prefetch_done":
        return a.prefetch_done(_args(msg, 1)[0], PREFETCH_WAIT_S)
    if op == "report":
        a.report, bad = check_report(_args(msg, 1)[0])
        if bad:  # counted and said (to the log: a report is a cast); the rest of the report is kept
            if metrics is not None:
                metrics.skipped(len(bad))
            raise ValueError(f"report: {len(bad)} samples skipped (the rest kept), the first {bad[0]}")
        return None
    if op == "events":  # [events], or [events, again]: the reply to the last never came
        again = msg[1] if len(msg) == 2 else False
        if len(msg) > 2 or type(again) is not bool:
            raise ValueError("events: no argument, or one: again (a boolean)")
        return a.log.read(a.reader, again)
    if op == "stats":
        st, dram = a.store.stats(), a.store.dram
        with dram.lock:
            pinned = sum(1 for e in dram.index.entries.values() if e.pins)
        return {"tiers": st["tiers"], "engine": a.name, "held": a.held, "refused": a.refused,
                "free_slots": dram.pool.n_free, "n_slots": dram.pool.n_slots, "pinned": pinned}
    if op == "ping":
        return "pong"
    raise ValueError(f"unknown op {op!r}")


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        d, sock = self.server.context, self.request  # type: ignore[attr-defined]
        serve_timeouts(sock, FRAME_S)
        try:
            a = self._hello(d, sock)
        except (ConnectionError, OSError, ValueError):
            return
        if a is None:
            return
        try:
            while True:
                try:
                    msg = wire.recv_request(sock, IDLE_S, FRAME_S)
                except (ConnectionError, OSError, ValueError):  # closed, idle, a stalled frame, not msgpack
                    return
                cast = isinstance(msg, list) and bool(msg) and msg[0] in CASTS
                try:
                    if not isinstance(msg, list) or not msg:
                        raise ValueError("a request is [op, args...]")
                    reply = [True, _serve(a, [CASTS.get(msg[0], msg[0]), *msg[1:]], d.metrics)]
                except Exception as e:  # noqa: BLE001 - a bad call is answered, never kills the daemon
                    log.debug("kvstore serve: %s from %s failed: %s", msg[0] if isinstance(msg, list) and msg
                              else "?", a.name, e)
                    reply = [False, f"{type(e).__name__}: {e}"]
                if cast:
                    continue
                try:
                    wire.send(sock, reply)
                except OSError:
                    return
        finally:
            d.closed(a)

    def _hello(self, d: NodeDaemon, sock) -> Attachment | None:
        """The first frame: ``attach`` (a new engine: its memfd follows the reply) or ``join``."""
        msg = wire.recv_request(sock, FRAME_S, FRAME_S)
        try:
            if isinstance(msg, list) and msg and msg[0] == "attach" and len(msg) == 6:
                a = d.attach(*msg[1:])
                pool = a.store.dram.pool
                hello = {"token": a.token, "slot_bytes": pool.slot_bytes, "n_slots": pool.n_slots,
                         "block_bytes": a.store.block_bytes, "pid": os.getpid(),
                         "populate": not a.store.dram.limited}
            elif msg == ["ping"]:  # a readiness check (kvstore serve --ping): answered, then closed
                wire.send(sock, [True, {"pid": os.getpid(), "engines": len(d.engines), "stores": len(d.stores)}])
                return None
            elif isinstance(msg, list) and len(msg) == 2 and msg[0] == "join":
                a, hello, pool = d.join(msg[1]), {"pid": os.getpid()}, None
            else:
                raise ValueError("the first request is attach or join")
        except (ConfigError, ValueError, LookupError, TypeError) as e:
            d.refused["attach"] += 1
            log.warning("kvstore serve: refused an engine: %s", e)
            wire.send(sock, [False, f"{type(e).__name__}: {e}"])
            return None
        try:  # attach and join counted this connection: its close releases the engine, whatever happens next
            wire.send(sock, [True, hello])
            if pool is not None:
                wire.send_fd(sock, pool.memfd)
        except OSError:
            d.closed(a)
            raise
        return a
