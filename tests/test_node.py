"""The node cache (issue 46): one ``kvstore serve`` per host, engines attached to it.

Engines here are :class:`~kvstore.node.client.NodeStore` s driven as the connector drives its
store (begin_store, write the slots, end_store; contains_prefix; pin_load, read_load, read the
views, end_load), in this process or in child processes that a test kills with -9. The daemon is
real: in this process where a test only needs it to serve, a ``kvstore serve`` process where a
test kills, stops or freezes it. Every fault is followed by the requests after it: a later
store and load of the same blocks must give back the right bytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from conftest import FP, blocks_for, make_keys
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.node.client import NodeStore, NodeUnavailable
from kvstore.node.daemon import NodeDaemon
from node_servers import Served

BB = 64 << 10  # a block: 16 slots a MiB


def node_config(tmp_path, *, name: str | None = None, dram_blocks: int = 64, nvme_blocks: int = 256, **node) -> dict:
    return {"tiers": {"dram": {"capacity_gb": dram_blocks * BB / (1 << 30), "pin_memory": False, "headroom_blocks": 0},
                      "nvme": {"path": str(tmp_path / "nvme"), "capacity_gb": nvme_blocks * (BB + 4096) / (1 << 30),
                               "header": "inline"}},
            "mode": "node", "node": {"name": name or f"t-{uuid.uuid4().hex[:12]}", **node}}


def engine(cfg: dict, name: str = "e", fp: ModelFingerprint = FP, events: bool = False) -> NodeStore:
    return NodeStore(from_dict(cfg), block_bytes=BB, fingerprint=fp, block_tokens=fp.block_size, name=name,
                     events=events)


def store(e: NodeStore, keys, data) -> int:
    h = e.begin_store(keys)
    for v, x in zip(h.views, data):
        if v is not None:
            v[:] = x
    return e.end_store(h, True)


def load(e: NodeStore, keys) -> list[np.ndarray]:
    """The leading blocks ``e`` can load, copied out (as the mover scatters them)."""
    h = e.pin_load(keys)
    try:
        n = e.read_load(h)
        return [v.copy() for v in h.views[:n]]
    finally:
        e.end_load(h)


@pytest.fixture
def daemon(tmp_path):
    made = []

    def make(**kw) -> tuple[NodeDaemon, dict]:
        cfg = node_config(tmp_path, **kw)
        d = NodeDaemon(from_dict(cfg)).start()
        made.append(d)
        return d, cfg

    yield make
    for d in made:
        d.close(persist=False)


@pytest.fixture
def served(tmp_path):
    made = []

    def make(**kw) -> Served:
        s = Served(tmp_path, node_config(tmp_path, **kw))
        made.append(s)
        return s

    yield make
    for s in made:
        if s.proc.returncode is None:
            try:
                s.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        s.close()


# -- sharing ---------------------------------------------------------------------------------------

def test_two_engines_share_one_copy_of_each_block(daemon):
    _, cfg = daemon()
    a, b = engine(cfg, "a"), engine(cfg, "b")
    try:
        keys, data = make_keys(8), blocks_for(make_keys(8), BB)
        assert store(a, keys, data) == 8
        m = b.contains_prefix(keys, record=False)
        assert m.num_blocks == 8 and set(m.tiers) == {"dram"}
        got = load(b, keys)
        assert len(got) == 8 and all(np.array_equal(g, x) for g, x in zip(got, data))
        assert store(b, keys, data) == 0  # stored once for the host
        st = b.stats()
        assert st["tiers"]["dram"]["blocks"] == 8 and st["n_slots"] - st["free_slots"] == 8  # 1x, not 2x
    finally:
        a.close()
        b.close()


def test_models_never_see_each_others_blocks(daemon):
    """Another model (or revision, dtype, layout, rank: anything in the fingerprint) gets a store
    of its own in the daemon: even its lookup of the first model's very keys finds nothing."""
    _, cfg = daemon()
    other = ModelFingerprint(model="another-model", dtype="float16", block_size=16, num_layers=2, num_kv_heads=2,
                             head_size=8)
    a, b = engine(cfg, "a"), engine(cfg, "b", fp=other)
    try:
        keys = make_keys(4)
        assert store(a, keys, blocks_for(keys, BB)) == 4
        assert b.contains_prefix(keys, record=False).num_blocks == 0
        assert load(b, keys) == []
        assert a.contains_prefix(keys, record=False).num_blocks == 4
    finally:
        a.close()
        b.close()


def test_one_engine_holds_at_most_its_share_of_the_slots(daemon):
    _, cfg = daemon(dram_blocks=16, engine_share=0.25)  # 4 slots each
    a, b = engine(cfg, "a"), engine(cfg, "b")
    try:
        keys = make_keys(12)
        h = a.begin_store(keys)
        assert sum(v is not None for v in h.views) == 4  # the rest refused, counted
        h2 = b.begin_store(make_keys(4, seed=1))
        assert all(v is not None for v in h2.views)  # a's reservation starved nobody
        assert a.stats()["refused"] == 8
        a.end_store(h, False)
        b.end_store(h2, False)
    finally:
        a.close()
        b.close()


def test_only_slots_are_charged_to_an_engines_share(daemon):
    """Blocks stored already (by another engine, say) neither take an engine's share nor push the
    new ones of the same request out of it: before, 4 stored blocks ahead of 4 new ones in an
    8-block request, with a share of 4, got the 4 new ones no slot."""
    d, cfg = daemon(dram_blocks=16, engine_share=0.25)  # 4 slots each
    a, b = engine(cfg, "a"), engine(cfg, "b")
    try:
        keys = make_keys(8, seed=7)
        data = blocks_for(keys, BB)
        assert store(b, keys[:4], data[:4]) == 4
        h = a.begin_store(keys)
        assert [v is not None for v in h.views] == [False] * 4 + [True] * 4
        assert next(x for x in d.engines.values() if x.name == "a").held == 4
        for v, x in zip(h.views, data):
            if v is not None:
                v[:] = x
        assert a.end_store(h, True) == 4
        assert b.contains_prefix(keys, record=False).num_blocks == 8
        got = load(b, keys[4:])  # (a pin is charged too: 4 at a time)
        assert len(got) == 4 and all(np.array_equal(g, x) for g, x in zip(got, data[4:]))
    finally:
        a.close()
        b.close()


# -- an engine dies ----------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from conftest import FP, make_keys
    from kvstore.config import from_dict
    from kvstore.node.client import NodeStore
    e = NodeStore(from_dict({cfg!r}), block_bytes={bb}, fingerprint=FP, block_tokens=16, name="child")
    keys = make_keys(8)
    if {what!r} == "save":
        h = e.begin_store(keys)
        for v in h.views:
            v[:] = 0xAB  # garbage, never published: the engine dies before end_store
    else:
        h = e.pin_load(keys)
        assert h.num_blocks == 8
    print("held", flush=True)
    sys.stdin.read()
""")


def _child(cfg: dict, what: str) -> subprocess.Popen:
    code = CHILD.format(tests=os.path.dirname(__file__), cfg=cfg, bb=BB, what=what)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < timeout, what
        time.sleep(0.02)


def test_an_engine_killed_mid_save_publishes_nothing_and_leaks_no_slot(daemon):
    _, cfg = daemon()
    a = engine(cfg, "a")
    try:
        free = a.stats()["free_slots"]
        p = _child(cfg, "save")
        assert a.stats()["free_slots"] == free - 8  # its reservation holds 8 slots
        p.kill()
        p.wait()
        _wait(lambda: a.stats()["free_slots"] == free, "the dead engine's slots were not freed")
        keys = make_keys(8)
        assert a.contains_prefix(keys, record=False).num_blocks == 0  # nothing half-written published
        data = blocks_for(keys, BB)
        assert store(a, keys, data) == 8  # the requests after it: stored and loaded right
        assert all(np.array_equal(g, x) for g, x in zip(load(a, keys), data))
    finally:
        a.close()


def test_an_engine_killed_mid_load_leaves_no_block_pinned(daemon):
    _, cfg = daemon(dram_blocks=8, engine_share=1.0)
    a = engine(cfg, "a")
    try:
        keys, data = make_keys(8), blocks_for(make_keys(8), BB)
        assert store(a, keys, data) == 8
        p = _child(cfg, "load")
        assert a.stats()["pinned"] == 8
        p.kill()
        p.wait()
        _wait(lambda: a.stats()["pinned"] == 0, "the dead engine's pins were not released")
        more, stored = make_keys(8, seed=5), []  # a full DRAM: these evict the (unpinned) first ones to NVMe
        _wait(lambda: stored.append(store(a, more, blocks_for(more, BB))) or sum(stored) == 8,
              "pinned blocks kept their slots")  # a victim keeps its slot until written down: a few rounds
        assert a.contains_prefix(more, record=False).tiers == ("dram",) * 8
        got = load(a, keys)  # from NVMe, through whatever slots are free: a right prefix, the rest recomputed
        assert all(np.array_equal(g, x) for g, x in zip(got, data))
        _wait(lambda: len(load(a, keys)) == 8, "the blocks never loaded whole")  # once the victims are written
    finally:
        a.close()


# -- the daemon dies, stalls, stops ------------------------------------------------------------------

def test_a_killed_daemon_is_a_miss_then_a_new_one_is_attached_again(served, tmp_path, caplog):
    s = served()
    a = engine(s.cfg, "a")
    try:
        keys, data = make_keys(6), blocks_for(make_keys(6), BB)
        assert store(a, keys, data) == 6
        pinned, copying = a.pin_load(keys), a.pin_load(keys)
        assert a.read_load(copying) == 6  # the engine is copying out of these slots when the daemon dies
        s.stop(signal.SIGKILL)
        with pytest.raises(NodeUnavailable):
            a.contains_prefix(keys, record=False)
        t = time.monotonic()
        for _ in range(20):  # in backoff: no socket touched, no wait
            with pytest.raises(NodeUnavailable):
                a.contains_prefix(keys, record=False)
            assert a.begin_store(keys).views == [None] * 6  # skipped, counted
        assert time.monotonic() - t < 1.0
        assert a.metrics.value("kvstore_tier_skipped_blocks_total", tier="dram", reason="node_down") == 120
        assert [r.message for r in caplog.records if "daemon" in r.message and r.levelname == "WARNING"][:1]
        s.start()  # a new daemon (DRAM was lost with -9; NVMe had nothing yet: write-back)
        _wait(lambda: _answers(a), "the engine never attached again", timeout=40)
        assert a.read_load(pinned) == 0  # a handle of the dead daemon: refused, not served
        assert a.end_load(pinned) is False
        assert a.end_load(copying) is False  # its pins went with the daemon: the mover fails that load
        assert store(a, keys, data) == 6
        assert all(np.array_equal(g, x) for g, x in zip(load(a, keys), data))
        assert a.counts["attached"] == 2
    finally:
        a.close()


def _answers(e: NodeStore) -> bool:
    try:
        e.contains_prefix(make_keys(1, seed=99), record=False)
        return True
    except NodeUnavailable:
        return False


def _stored(e: NodeStore, keys) -> bool:
    """Stored (again, if a call timed out), and every block held."""
    try:
        store(e, keys, blocks_for(keys, BB))
        return e.contains_prefix(keys, record=False).num_blocks == len(keys)
    except NodeUnavailable:
        return False


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_stuck_daemon_costs_at_most_the_timeout(served):
    s = served(timeout_ms=300)
    a = engine(s.cfg, "a")
    try:
        keys = make_keys(4)
        # stored before the stop; on a loaded machine one call may pass the 300 ms under test here
        _wait(lambda: _answers(a) and _stored(a, keys), "the first store never went through", timeout=40)
        os.kill(s.proc.pid, signal.SIGSTOP)
        # stopped once /proc says so: a thread already running finishes its slice first (a lookup
        # sent right after the kill was answered in 0.7 ms, while the state still read "R")
        _wait(lambda: _state(s.proc.pid) == "T", "the daemon did not stop")
        t = time.monotonic()
        with pytest.raises(NodeUnavailable):
            a.contains_prefix(keys, record=False)
        assert time.monotonic() - t < 0.3 + 1.0  # its timeout, not forever
        os.kill(s.proc.pid, signal.SIGCONT)
        _wait(lambda: _answers(a), "the engine never attached again", timeout=40)
        assert a.contains_prefix(keys, record=False).num_blocks == 4  # the daemon lived: its DRAM too
    finally:
        a.close()


def test_a_graceful_stop_writes_dram_down_and_the_next_daemon_serves_it(served):
    s = served()
    a = engine(s.cfg, "a")
    keys, data = make_keys(10), blocks_for(make_keys(10), BB)
    try:
        assert store(a, keys, data) == 10
    finally:
        a.close()
    out = s.stop(signal.SIGTERM)
    assert s.proc.returncode == 0, out
    assert "written down: yes" in out
    s.start()
    b = engine(s.cfg, "b")
    try:
        m = b.contains_prefix(keys, record=False)
        assert m.num_blocks == 10 and set(m.tiers) == {"nvme"}
        got = load(b, keys)  # read by the daemon into its slab, copied by the engine
        assert len(got) == 10 and all(np.array_equal(g, x) for g, x in zip(got, data))
    finally:
        b.close()


# -- trust -----------------------------------------------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_another_user_is_refused(daemon, tmp_path):
    d, cfg = daemon()
    code = textwrap.dedent(f"""
        import os, socket
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect({d.server.server_address!r})
            s.settimeout(5)
            print("read", s.recv(1))
        except OSError as e:
            print("refused", type(e).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30).stdout
    assert out.startswith("refused") or out.strip() == "read b''", out  # the folder, or SO_PEERCRED
    assert not d.engines


def test_the_slab_is_private_and_sealed(daemon):
    import fcntl
    import stat

    d, cfg = daemon()
    a = engine(cfg, "a")
    try:
        fd = next(iter(d.stores.values())).dram.pool.memfd
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        seals = fcntl.fcntl(fd, getattr(fcntl, "F_GET_SEALS", 1034))
        assert seals & 2 and seals & 4  # no shrink, no grow: no peer can SIGBUS another's mapping
        with pytest.raises(OSError):
            os.ftruncate(fd, 4096)
    finally:
        a.close()


def test_an_engines_tiers_ask_nothing_of_the_machine_in_node_mode(tmp_path):
    """Its tiers are the daemon's: an engine's config with more DRAM than the machine has is fine
    in node mode (checked, and refused, in the daemon's)."""
    from kvstore.store.machine import config_errors

    big = {"tiers": {"dram": {"capacity_gb": 1e6}}}
    _, errors = config_errors(overrides={**big, "mode": "node"})
    assert errors == []
    _, errors = config_errors(overrides=big)
    assert [e.key for e in errors] == ["tiers.dram.capacity_gb"]
    _, errors = config_errors(overrides={**big, "mode": "node"}, daemon=True)
    assert [e.key for e in errors] == ["tiers.dram.capacity_gb"]


def test_a_load_whose_daemon_is_lost_while_it_copies_is_failed_not_served(tmp_path):
    """The mover copies out of pinned slab slots; if the pins go meanwhile (the daemon lost), other
    engines may have written those slots: the load is failed (vLLM recomputes), never counted served."""
    import threading

    from kvstore import failpoints, kvcopy
    from kvstore.offload import LocalClient, StepRunner, acquire_shared, release_shared
    from kvstore.offload.planner import Planner
    from test_planner_rollback import BS, new_request, toks

    cache = np.zeros((32, 1, BS, 16), np.float16)  # vLLM's CPU layout, one layer
    layout = kvcopy.KVLayout.from_vllm([cache])
    fp = ModelFingerprint(model="node-mover", dtype="float16", block_size=BS, num_layers=1, num_kv_heads=1,
                          head_size=8, layout=f"x.{layout.packing}")
    cfg = node_config(tmp_path)
    d = NodeDaemon(from_dict(cfg)).start()
    shared = acquire_shared("node-mover/tp0", from_dict(cfg), fp, layout.block_bytes, BS)
    try:
        mover = StepRunner(shared)
        mover.register([cache], layout)
        planner = Planner(LocalClient(shared), fp, BS, prefetch=False)
        t = toks(26, 3)  # 6 full blocks
        other = NodeStore(from_dict(cfg), block_bytes=layout.block_bytes, fingerprint=fp, block_tokens=BS)
        keys = chain_keys(fp, t, BS)[:6]
        good = np.random.default_rng(1).standard_normal((6,) + cache.shape[1:]).astype(np.float16)
        assert store(other, keys, [g.view(np.uint8).reshape(-1) for g in good]) == 6
        other.close()
        st, hit = new_request(planner, "a", t)
        assert hit == 24
        planner.allocated(st, 24)
        ids = list(range(10, 16))
        plan = planner.build_step([("a", ids + [16], 24)], [], {"a": 2})
        before = failpoints.fired("mover.scatter")  # counted over the process: earlier tests fired it too
        failpoints.arm("mover.scatter=hold*1")
        failpoints.close_gate()
        worker = threading.Thread(target=mover.load, args=(plan,))
        worker.start()
        _wait(lambda: failpoints.fired("mover.scatter") > before, "the load never reached its copy")
        d.close(persist=False)  # the daemon goes, and with it the pins, while the load copies
        failpoints.open_gate()
        worker.join(30)
        assert mover.take_load_errors() == set(ids)
        assert shared.metrics.registry.get_sample_value("kvstore_engine_served_tokens_total", {"tier": "dram"}) \
            in (None, 0.0)
        mover.close()
    finally:
        failpoints.clear()
        release_shared(shared)
        d.close(persist=False)


# -- what a slow daemon must not cost: found by a review (each failed before its fix) ---------------

def _slow_once(e: NodeStore, call) -> None:
    """``call`` on a new thread of ``e`` with a timeout nothing meets: the daemon looks stuck to it."""
    import threading

    t0, e.timeout = e.timeout, 1e-9
    err = []
    th = threading.Thread(target=lambda: err.append(pytest.raises(NodeUnavailable, call)))
    th.start()
    th.join()
    e.timeout = t0
    assert err


def test_a_slow_daemon_never_frees_what_an_engine_is_still_writing(daemon):
    """A join that timed out closed the anchor: the daemon freed the engine's reserved slots while
    its gather was still writing them, another engine published its blocks there, and the late
    gather overwrote them (wrong bytes in 4 of 4 blocks served)."""
    _, cfg = daemon(dram_blocks=8, engine_share=1.0)
    a, b = engine(cfg, "a"), engine(cfg, "b")
    try:
        ka, kb = make_keys(4, seed=1), make_keys(4, seed=2)
        r = a.begin_store(ka)
        free = b.stats()["free_slots"]
        _slow_once(a, lambda: a.contains_prefix(ka, record=False))
        time.sleep(0.2)
        assert b.stats()["free_slots"] == free  # a's reservation still holds its slots
        good = blocks_for(kb, BB)
        store(b, kb, good)  # into other slots, or skipped: never a's
        for v in r.views:
            v[:] = 0xA  # a's gather lands late
        _wait(lambda: _answers(a), "a never answered again")
        assert a.end_store(r, True) == 4
        got = load(b, kb)
        assert all(np.array_equal(g, x) for g, x in zip(got, good))
        assert all((x == 0xA).all() for x in load(b, ka))
    finally:
        a.close()
        b.close()


def test_a_pin_whose_answer_never_came_is_ended_later(daemon):
    """The daemon pinned, the engine gave up waiting: the pin was held until the engine detached
    (for a long-lived engine, never), and enough of them starve it of its share."""
    _, cfg = daemon()
    a, b = engine(cfg, "a"), engine(cfg, "b")
    try:
        keys = make_keys(4)
        assert store(a, keys, blocks_for(keys, BB)) == 4  # this thread has its connection now

        def slow(call) -> None:  # on this connection, a timeout nothing meets
            t0, a.timeout = a.timeout, 1e-9
            try:
                with pytest.raises(NodeUnavailable):
                    call()
            finally:
                a.timeout = t0

        slow(lambda: a.pin_load(keys))
        _wait(lambda: _answers(a), "a never answered again")  # its first call flushes the queued end
        _wait(lambda: b.stats()["pinned"] == 0, "the pin whose answer never came is still held")
        h = a.pin_load(keys)
        slow(lambda: a._call("read", h.hid))  # a read that times out: its end must still go
        a.end_load(h)
        _wait(lambda: _answers(a), "a never answered again")
        _wait(lambda: b.stats()["pinned"] == 0, "the pin of a read that timed out is still held")
    finally:
        a.close()
        b.close()


def test_connections_of_threads_that_ended_are_closed(daemon):
    import threading

    d, cfg = daemon()
    a = engine(cfg, "a")
    try:
        for i in range(20):  # vLLM's RPC server makes a thread per scheduler connection
            th = threading.Thread(target=lambda: a.contains_prefix(make_keys(1, seed=i), record=False))
            th.start()
            th.join()
        assert len(a._links) <= 2
        assert next(iter(d.engines.values())).connections <= 3  # the anchor and at most two links
    finally:
        a.close()


@pytest.mark.parametrize("msg", [["end_store", 7, "not a list"], ["pin", 5, [], {"a": 1}, None],
                                 ["pin", -1, [], None, None], ["lookup", "x", False, None, 0],
                                 ["pin", 5, [b"short"], None, None], ["begin_store", 2**70, [], None, None],
                                 ["begin_store", 9, [], None, [b"a name of a block that is not there"]],
                                 ["begin_store", 9, [], None, "not a list"], ["events", 1],
                                 ["report", [["kvstore_engine_requests_total", {"engine": "forged"}, 1]]],
                                 ["report", [["process_cpu_seconds_total", {}, 1]]],
                                 ["report", [["kvstore_engine_requests_total", {}, -1]]]])
def test_a_bad_call_is_refused_before_it_holds_anything(daemon, msg):
    from kvstore.node.daemon import _serve

    d, cfg = daemon()
    a = engine(cfg, "a")
    try:
        keys = make_keys(2)
        r = a.begin_store(keys)
        att = next(iter(d.engines.values()))
        held = att.held
        with pytest.raises((ValueError, TypeError, LookupError)):
            _serve(att, [*msg[:1], *([r.sid] if msg[0] == "end_store" else msg[1:2]), *msg[2:]])
        assert att.held == held and len(att.loads) == 0 and r.sid in att.stores  # nothing taken, nothing lost
        assert a.end_store(r, True) == 2
    finally:
        a.close()


# -- KV events -------------------------------------------------------------------------------------
def metas_of(keys, seed: int = 0) -> list:
    """The engine's names of a chain of blocks (vLLM's block hash, parent, tokens), as the
    connector gives them to the mover."""
    from kvstore.store.events import BlockMeta

    hashes = [bytes([seed, i]) * 16 for i in range(len(keys))]
    return [BlockMeta(h, hashes[i - 1] if i else None, tuple(range(16 * i + seed, 16 * i + seed + 16)))
            for i, h in enumerate(hashes)]


def announced(records) -> dict:
    """tier -> {block hash: stored?} after applying the records in order."""
    out: dict = {}
    for stored, tier, m in records:
        out.setdefault(tier, {})[m.block_hash] = stored
    return out


def test_each_engine_announces_the_daemons_blocks_it_can_load(daemon):
    """A router reading engine B's KV-event stream sees what engine A stored in the daemon (B can
    load it), a new engine's first read is every block held, an eviction out of DRAM is announced
    removed there and stored on NVMe, and an engine without events is sent nothing."""
    d, cfg = daemon(dram_blocks=8, engine_share=1.0)
    a, b, quiet = engine(cfg, "a", events=True), engine(cfg, "b", events=True), engine(cfg, "q")
    try:
        assert b.take_events() == [] and quiet.events is None
        k1, k2 = make_keys(4, seed=1), make_keys(8, seed=2)
        m1, m2 = metas_of(k1, 1), metas_of(k2, 2)
        a.events.remember(k1, m1)  # as the mover does, before the reservation
        assert store(a, k1, blocks_for(k1, BB)) == 4
        got = b.take_events()
        assert sorted(got, key=str) == sorted([(True, "dram", m) for m in m1], key=str)  # A's names, tokens and all
        assert b.take_events() == []  # read once
        assert announced(a.take_events()) == {"dram": {m.block_hash: True for m in m1}}  # A's own stream too
        late = engine(cfg, "late", events=True)
        try:
            assert announced(late.take_events()) == {"dram": {m.block_hash: True for m in m1}}  # what is held
        finally:
            late.close()
        a.events.remember(k2, m2)
        assert store(a, k2, blocks_for(k2, BB)) >= 4  # 8 DRAM slots: k1 goes down to NVMe
        st = next(iter(d.stores.values()))
        st.flush()
        seen = announced(b.take_events())
        # what B announces is what the daemon holds: k1 left DRAM for NVMe, k2 went into DRAM
        truth = {t: {m.block_hash for k, m in zip(k1 + k2, m1 + m2) if k in set(getattr(st, t).index.keys())}
                 for t in ("dram", "nvme")}
        assert {t: {h for h, on in seen[t].items() if on} for t in seen} == truth
        assert truth["nvme"] == {m.block_hash for m in m1} and not truth["dram"] & truth["nvme"]
        assert {h for h, on in seen["dram"].items() if not on} == {m.block_hash for m in m1}
        assert quiet.take_events() == []
        assert b.contains_prefix(k1, record=False).num_blocks == 4  # B can load what it announces
        from kvstore.connectors.vllm.events import vllm_events

        media = {e.medium for e in vllm_events(got, from_dict(cfg).events, 16)}
        assert media == {"CPU"}
    finally:
        for e in (a, b, quiet):
            e.close()


def test_a_reader_the_log_ran_past_reads_the_held_blocks_again(daemon, monkeypatch):
    from kvstore.node import eventlog

    monkeypatch.setattr(eventlog, "MAX_RECORDS", 4)
    d, cfg = daemon(engine_share=1.0)
    a, b = engine(cfg, "a", events=True), engine(cfg, "b", events=True)
    try:
        assert b.take_events() == []
        keys = make_keys(8, seed=3)
        a.events.remember(keys, metas_of(keys, 3))
        assert store(a, keys, blocks_for(keys, BB)) == 8
        next(iter(d.logs.values())).drain()  # 8 records into a log of 4: B's place in it is gone
        assert announced(b.take_events()) == {"dram": {m.block_hash: True for m in metas_of(keys, 3)}}
        assert next(iter(d.logs.values())).lost == 1
    finally:
        a.close()
        b.close()


# -- operators -------------------------------------------------------------------------------------
def test_the_daemon_exports_each_engines_hit_rate_and_the_hosts(tmp_path):
    """``kvstore stats --url`` on the daemon's port: the host's readout (its tiers, every engine's
    tokens summed), then one line per engine, from the counters each engine reports; an engine that
    detached keeps its figures."""
    from kvstore.bench.common.ports import free_port
    from kvstore.offload.metrics import OffloadMetrics, RequestOutcome
    from kvstore.ops.stats import fetch, render

    port = free_port()
    cfg = node_config(tmp_path, engine_share=1.0)
    d = NodeDaemon(from_dict({**cfg, "metrics": {"port": port}})).start()  # the engines export nothing
    a, b = engine(cfg, "engine-a"), engine(cfg, "engine-b")
    try:
        keys = make_keys(4, seed=5)
        assert store(a, keys, blocks_for(keys, BB)) == 4
        for e, prompt, local, served in ((a, 100, 20, 40), (b, 200, 0, 150)):
            m = OffloadMetrics(e.metrics.registry)  # as the connector counts
            m.record(RequestOutcome(req_id="r", prompt=prompt, local=local, promised=served, got=served, tiers=("dram",)))
            m.served_tokens.labels("dram").inc(served)
            e._report(force=True)
        url = f"http://127.0.0.1:{port}/metrics"
        give_up = time.monotonic() + 10
        while (s := fetch(url))["engine"] is None or s["engine"]["prompt_tokens"] < 300:  # the reports are casts
            assert time.monotonic() < give_up, s
            time.sleep(0.05)
        assert s["engine"]["prompt_tokens"] == 300 and s["engine"]["served_tokens"]["dram"] == 190
        assert abs(s["engine"]["hit_rate"] - 190 / 280) < 1e-9  # the host's: every engine's tokens
        assert s["tiers"]["dram"]["blocks"] == 4  # the daemon's own store
        assert {n: e["hit_rate"] for n, e in s["engines"].items()} == {"engine-a": 0.5, "engine-b": 0.75}
        assert "engine-a" in render(s) and "engines (2" in render(s)
        a.close()
        s = fetch(url)
        assert s["engines"]["engine-a"]["hit_rate"] == 0.5 and s["engine"]["prompt_tokens"] == 300
    finally:
        a.close()
        b.close()
        d.close(persist=False)
