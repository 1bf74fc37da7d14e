"""kvstore as an LMCache L2 adapter (``kvstore.connectors.lmcache``), driven by LMCache 0.5.6's own
code: its ``--l2-adapter`` parser and plugin loader build the adapter, its L1 memory manager
allocates the memory objects, its ``Bitmap`` and event fds carry the results.

LMCache is never imported here (it pulls CUDA packages and another numpy): like the bench's peer
(``bench/tiers/peer.py``, ``make peers``), the checks run in ``.venv-peers`` as a subprocess; the
module is skipped cleanly without that venv. The peers venv has no kvstore: the script puts this
test venv's site-packages after its own (``site.addsitedir``, as the compat venv's ``.pth`` does in
the Makefile), so kvstore, its native modules and its editable mapping of ``connectors/`` onto
``kvstore.connectors`` come from here while torch, numpy and lmcache stay the peer venv's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from redis_servers import redis_single  # noqa: F401  (skipped where redis-server is not on PATH)

ROOT = Path(__file__).resolve().parents[1]
PEER_PY = ROOT / ".venv-peers" / "bin" / "python"

SCRIPT = r'''
import argparse, json, os, select, site, stat, sys, threading, time
site.addsitedir(sys.argv[1])  # kvstore (this checkout, editable) after the peer venv's own packages
work = sys.argv[2]

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1MemoryManagerConfig
from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
from lmcache.v1.platform.event_notifier import consume_fd

facts = {}
mode = sys.argv[3]
SHAPE, DTYPE = torch.Size([2, 4, 16, 64]), torch.bfloat16  # (K/V, layers, tokens, hidden): 16 KiB
LAYOUT = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[DTYPE])
CHUNK = 2 * 4 * 16 * 64 * 2
NVME = os.path.join(work, "kv")
l1 = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=64 << 20, use_lazy=False, shm_name=""))

def params(**kw):
    cfg = {"tiers": {"dram": {"capacity_gb": 8 * (CHUNK + 4096) / 2**30, "pin_memory": False, "headroom_blocks": 0},
                     "nvme": {"path": NVME, "capacity_gb": 0.05}}}
    return {"config": cfg, "chunk_bytes": CHUNK, **kw}

def make(p):
    """As `lmcache server --l2-adapter JSON` does: parse the flag, then the plugin loader."""
    ap = add_l2_adapters_args(argparse.ArgumentParser())
    spec = {"type": "plugin", "module_path": "kvstore.connectors.lmcache.adapter",
            "class_name": "KVStoreL2Adapter", "adapter_params": p}
    cfg = parse_args_to_l2_adapters_config(ap.parse_args(["--l2-adapter", json.dumps(spec)]))
    return create_l2_adapter(cfg.adapters[0])

def wait(fd, query, timeout=90.0):  # a liveness bound (a loaded 2-core machine once passed 20 s), not a timing
    end = time.time() + timeout
    p = select.poll(); p.register(fd, select.POLLIN)
    while time.time() < end:
        got = query()
        if got is not None:
            return got
        if p.poll(100):
            consume_fd(fd)
    raise TimeoutError("no result")

def store(ad, keys, objs):
    tid = ad.submit_store_task(keys, objs)
    return wait(ad.get_store_event_fd(), lambda: ad.pop_completed_store_tasks().get(tid))

def lookup(ad, keys, descs=None):
    tid = ad.submit_lookup_and_lock_task(keys, {0: LAYOUT} if descs is None else descs)
    bits = wait(ad.get_lookup_and_lock_event_fd(), lambda: ad.query_lookup_and_lock_result(tid))
    facts.setdefault("second_query", []).append(ad.query_lookup_and_lock_result(tid) is None)  # once
    return bits.get_indices_list()

def alloc(n, layout=LAYOUT, fill=0xAB):
    err, objs = l1.allocate(layout, n)
    assert objs, err
    for o in objs:
        o.tensor.view(torch.uint8).fill_(fill)
    return objs

def load(ad, keys, objs):
    tid = ad.submit_load_task(keys, objs)
    return wait(ad.get_load_event_fd(), lambda: ad.query_load_result(tid)).get_indices_list()

def key(i, model="org/model-a", rank=0, world=1):
    kv_rank = ObjectKey.ComputeKVRank(world_size=world, global_rank=rank, local_world_size=world, local_rank=rank)
    return ObjectKey(chunk_hash=i.to_bytes(8, "big") * 2, model_name=model, kv_rank=kv_rank)

def pins(ad):
    return sum(e.pins for t in ad.store.tiers for e in t.index.entries.values())

if mode == "local":
    # -- store, lookup and lock, load, unlock -----------------------------------------------------
    import kvstore.connectors.lmcache.adapter as A
    A.STAGE_BYTES = 2 * (CHUNK + 4096)  # a worker stages two chunks: a task of six is put in three slices
    ad = make(params())
    facts["is_interface"] = isinstance(ad, L2AdapterInterface)
    facts["fds"] = [ad.get_store_event_fd(), ad.get_lookup_and_lock_event_fd(), ad.get_load_event_fd()]
    facts["memory_tags"] = ad.get_memory_tags()
    keys = [key(i) for i in range(6)]
    src = alloc(6, fill=0)
    for i, o in enumerate(src):
        u8 = o.tensor.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
    want = [bytes(o.byte_array) for o in src]
    res = store(ad, keys, src)
    facts["store_ok"], facts["store_bytes"] = res.is_successful(), res.bytes_transferred()
    again = store(ad, keys[:2], src[:2])
    facts["restore_bytes"] = again.bytes_transferred()
    absent = [key(100), key(101)]
    facts["lookup"] = lookup(ad, keys + absent)
    facts["pins_locked"] = pins(ad)
    facts["status_locked"] = ad.report_status()["locked_chunks"]
    dst = alloc(6)
    facts["load"] = load(ad, keys, dst)
    facts["bytes_equal"] = [bytes(o.byte_array) == w for o, w in zip(dst, want)]
    # another layout (the same bytes' length, another dtype): a miss at lookup and at load
    other = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[torch.float16])
    facts["lookup_other_layout"] = lookup(ad, keys[:2], {0: other})
    odst = alloc(2, layout=other)
    facts["load_other_layout"] = load(ad, keys[:2], odst)
    facts["other_layout_untouched"] = all(bytes(o.byte_array) == b"\xab" * CHUNK for o in odst)
    ad.submit_unlock(keys + absent)
    facts["pins_unlocked"] = pins(ad)
    facts["usage"] = ad.get_usage().total_bytes_used
    # gaps: each stored run is pinned by one call; a chunk unlocked alone leaves its run's others loadable
    gap = [keys[0], absent[0], keys[1], keys[2], absent[1], keys[3]]
    facts["lookup_gaps"] = lookup(ad, gap)
    facts["pins_gaps"] = pins(ad)
    ad.submit_unlock([keys[1]])
    g = alloc(3)
    facts["load_after_partial_unlock"] = load(ad, [keys[0], keys[2], keys[3]], g)
    facts["gap_bytes_equal"] = [bytes(o.byte_array) == want[i] for o, i in zip(g, (0, 2, 3))]
    facts["pins_partial"] = pins(ad)
    ad.submit_unlock([keys[0], keys[2], keys[3]])
    facts["pins_after_gaps"] = pins(ad)
    l1.free(src + dst + odst + g)

    # -- a second thread storing while the first looks up, loads and unlocks ------------------------
    more = [key(200 + i) for i in range(12)]
    mobjs = alloc(12, fill=0)
    for i, o in enumerate(mobjs):
        o.tensor.view(torch.uint8).fill_(i + 1)
    errs = []
    def storer():
        try:
            for j in range(0, 12, 3):
                if not store(ad, more[j:j + 3], mobjs[j:j + 3]).is_successful():
                    errs.append("store failed")
        except Exception as e:
            errs.append(repr(e))
    t = threading.Thread(target=storer); t.start()
    bad = 0
    for _ in range(20):
        found = lookup(ad, keys)
        d = alloc(6)
        got = load(ad, keys, d)
        bad += sum(bytes(o.byte_array) != w for o, w in zip(d, want)) + (len(found) != 6) + (len(got) != 6)
        ad.submit_unlock(keys)
        l1.free(d)
    t.join()
    facts["threads_bad"], facts["threads_errs"] = bad, errs
    facts["pins_after_threads"] = pins(ad)
    # LMCache's store controller pops completed stores on its own thread while tasks complete on
    # the adapter's: a completion written into the dict a pop had just swapped out was lost (34 of
    # 3,000 before the fix, found by bench tiers --peer lmcache-l2)
    tids, got, stop = [], {}, threading.Event()
    def popper():
        while not stop.is_set():
            got.update(ad.pop_completed_store_tasks())
    pt = threading.Thread(target=popper); pt.start()
    for i in range(1500):
        tids.append(ad.submit_store_task([key(1000 + i % 50)], mobjs[:1]))
    end = time.time() + 90
    while time.time() < end and len(got) < len(tids):
        time.sleep(0.05)
    stop.set(); pt.join(); got.update(ad.pop_completed_store_tasks())
    facts["lost_completions"] = sum(t not in got for t in tids)
    ad.close()
    l1.free(mobjs)

    # -- files: 0600 in 0700 folders ----------------------------------------------------------------
    modes = set()
    for d, subdirs, files in os.walk(NVME):
        modes.add(("dir", stat.S_IMODE(os.stat(d).st_mode)))
        modes |= {("file", stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode)) for f in files}
    facts["modes"] = sorted(modes)

    # -- a restart: from NVMe, checksummed; a damaged file is a miss ----------------------------------
    ad = make(params())
    path = next(p for d, _, fs in os.walk(NVME) for f in fs
                if f.startswith(ad._key(keys[3]).hex()) for p in [os.path.join(d, f)])
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size - CHUNK // 2)  # inside the object's bytes
        b = f.read(1); f.seek(size - CHUNK // 2); f.write(bytes([b[0] ^ 0xFF]))
    facts["restart_lookup"] = lookup(ad, keys)
    d = alloc(6)
    facts["restart_load"] = load(ad, keys, d)
    facts["restart_equal"] = [bytes(o.byte_array) == w for o, w in zip(d, want)]
    facts["damaged_untouched"] = bytes(d[3].byte_array) == b"\xab" * CHUNK
    ad.submit_unlock(keys)
    # a load without a lookup first (not what LMCache does, but never wrong bytes either)
    d2 = alloc(6)
    facts["unlocked_load"] = load(ad, keys, d2)
    facts["unlocked_damaged_untouched"] = bytes(d2[3].byte_array) == b"\xab" * CHUNK
    facts["restart_pins"] = pins(ad)
    facts["counted_bad_checksum"] = ad.store.metrics.value("kvstore_corrupt_files_total", tier="nvme",
                                                           reason="bad_checksum")
    l1.free(d + d2)
    # another model, another rank, the same chunk hashes, the same folder: nothing shared
    facts["other_model"] = lookup(ad, [key(i, model="org/model-b") for i in range(6)])
    facts["other_rank"] = lookup(ad, [key(i, rank=1, world=2) for i in range(6)])
    ad.close()
    ad = make(params(namespace="tenant-2"))
    facts["other_namespace"] = lookup(ad, keys)
    ad.close()

    # -- bad adapter_params: a clear error naming the key --------------------------------------------
    errors = {}
    for name, p in {"chunk": params(chunk_bytes="16k"), "unknown": params(chunk_size=256),
                    "config": params(config=3), "config_key": params(config={"tiers": {"dram": {"capacity": 1}}}),
                    "missing": {"config": params()["config"]}}.items():
        try:
            make(p).close()
            errors[name] = None
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    facts["errors"] = errors

if mode == "manager":  # LMCache's own StorageManager: its L1, its store and prefetch controller threads
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.distributed.storage_manager import StorageManager

    def manager():
        ap = add_storage_manager_args(argparse.ArgumentParser())
        spec = {"type": "plugin", "module_path": "kvstore.connectors.lmcache.adapter",
                "class_name": "KVStoreL2Adapter", "adapter_params": params()}
        sm = StorageManager(parse_args_to_config(ap.parse_args(
            ["--l1-size-gb", "0.0625", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)])))
        return sm, sm.l2_adapters()[0][1]

    def prefetch(sm, keys):
        """What the server does for a retrieve: prefetch into L1 (lookup, lock, load, unlock in L2), read."""
        h = sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0,
                                                                                   layout_desc=LAYOUT)]))
        assert sm.wait_prefetch_status(h, 30)
        r = sm.query_prefetch_status(h)
        hits = r.hit_cells[0].get_indices_list()
        with sm.read_prefetched_results([keys[i] for i in hits], r.l1_owners) as got:
            same = [bytes(o.byte_array) == want[keys[i]] for i, o in zip(hits, got or [])]
        sm.finish_read_prefetched([keys[i] for i in hits])
        return hits, r.l2_hit_cells[0].get_indices_list(), same

    sm, ad = manager()
    facts["loaded_by"] = type(ad).__name__
    keys = [key(300 + i) for i in range(5)]
    objs = sm.reserve_write(keys, LAYOUT)
    want = {}
    for i, k in enumerate(keys):
        u8 = objs[k].tensor.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(50 + i)))
        want[k] = bytes(objs[k].byte_array)
    sm.finish_write(keys)
    end = time.time() + 30
    while sum(ad.report_status()["blocks_per_tier"].values()) < 5 and time.time() < end:
        time.sleep(0.05)
    facts["stored_blocks"] = sum(ad.report_status()["blocks_per_tier"].values())
    facts["l1_deleted"] = sm.delete_l1_keys(keys, force=True)[0]
    facts["hits"], facts["l2_hits"], facts["same"] = prefetch(sm, keys)
    time.sleep(0.2)
    facts["pins_after"] = pins(ad)
    sm.close()
    # a restart: a new server on the same folder; chunk 2's file damaged
    sm, ad = manager()
    path = next(os.path.join(d, f) for d, _, fs in os.walk(NVME) for f in fs if f.startswith(ad._key(keys[2]).hex()))
    with open(path, "r+b") as f:
        f.seek(-CHUNK // 2, os.SEEK_END)
        b = f.read(1); f.seek(-CHUNK // 2, os.SEEK_END); f.write(bytes([b[0] ^ 0xFF]))
    facts["restart_hits"], facts["restart_l2_hits"], facts["restart_same"] = prefetch(sm, keys)
    time.sleep(0.2)
    facts["restart_pins_after"] = pins(ad)
    sm.close()

if mode == "redis":  # the shared tier alone (no DRAM, no NVMe): HMAC-authenticated values
    url = sys.argv[4]
    cfg = {"tiers": {"dram": {"capacity_gb": 0, "pin_memory": False}, "nvme": {"capacity_gb": 0},
                     "remote": {"url": url, "timeout_ms": 5000}}}
    import numpy as np
    from kvstore.tiers import fileformat as ff
    from kvstore.tiers.redis.value import MAC_BYTES
    ad = make({"config": cfg, "chunk_bytes": CHUNK})
    facts["memory_tags"] = ad.get_memory_tags()
    keys = [key(i, model="org/model-r") for i in range(4)]
    src = alloc(4, fill=0)
    for i, o in enumerate(src):
        o.tensor.view(torch.uint8).fill_(i + 1)
    want = [bytes(o.byte_array) for o in src]
    facts["store_ok"] = store(ad, keys, src).is_successful()
    facts["lookup"] = lookup(ad, keys)
    d = alloc(4)
    facts["load"] = load(ad, keys, d)
    facts["equal"] = [bytes(o.byte_array) == w for o, w in zip(d, want)]
    ad.submit_unlock(keys)
    l1.free(d)
    # forge: chunk 1's value is chunk 2's honest value (a valid MAC, for another key); chunk 3's is
    # a value with a valid header and xxh3 for other bytes, and a MAC made without the secret
    client = ad.store.tier("remote").client
    import redis as redis_py
    c = redis_py.Redis.from_url(url, password=os.environ["KVSTORE_REDIS_PASSWORD"])
    names = [client.redis_key(ad._key(k)) for k in keys]
    c.set(names[1], c.get(names[2]))
    evil = np.full(4096 + CHUNK, 7, np.uint8)
    evil[:4096] = np.frombuffer(bytes(4096), np.uint8)
    head = ff.header_bytes(ff.Header(client.values.codec_id, evil.nbytes, ff.checksum(evil), time.time(),
                                     client.namespace, ad._key(keys[3]), ff.FLAG_MAC))
    c.set(names[3], head + evil.tobytes() + os.urandom(MAC_BYTES))
    facts["forged_lookup"] = lookup(ad, keys)
    d = alloc(4)
    facts["forged_load"] = load(ad, keys, d)
    facts["forged_equal"] = [bytes(o.byte_array) == w for o, w in zip(d, want)]
    facts["forged_untouched"] = [bytes(d[i].byte_array) == b"\xab" * CHUNK for i in (1, 3)]
    facts["unauthenticated"] = ad.store.metrics.value("kvstore_corrupt_files_total", tier="remote",
                                                      reason="unauthenticated")
    ad.submit_unlock(keys)
    l1.free(d + src)
    ad.close()
print("FACTS " + json.dumps(facts))
'''


def _peer_ready(py: Path = PEER_PY) -> str | None:
    """None when the peer venv can run LMCache, else why not (the tests that need it are skipped)."""
    if not py.exists():
        return "no .venv-peers (make peers)"
    r = subprocess.run([str(py), "-c", "import lmcache.v1.distributed.l2_adapters.plugin_l2_adapter"],
                       capture_output=True, text=True, timeout=120, cwd="/")
    return None if r.returncode == 0 else f"lmcache not importable in .venv-peers: {r.stderr.strip()[-200:]}"


def _drive(work: Path, *args: str, env: dict | None = None) -> dict:
    """Run the script in the peer venv; its facts."""
    why = _peer_ready()
    if why:
        pytest.skip(why)
    script = work / "drive.py"
    script.write_text(SCRIPT)
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE")}
    e.update(PYTHONPATH=str(ROOT), LMCACHE_LOG_LEVEL="WARNING", **(env or {}))
    r = subprocess.run([str(PEER_PY), str(script), sysconfig.get_paths()["purelib"], str(work), *args],
                       capture_output=True, text=True, timeout=300, cwd=str(work), env=e)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("FACTS ")), None)
    assert r.returncode == 0 and line, f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(line[len("FACTS "):])


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    return _drive(tmp_path_factory.mktemp("lmcache-l2"), "local")


def test_through_lmcaches_storage_manager(tmp_path):
    """The server's path without its transport: L1 writes, its store controller pushes them into the
    adapter, its prefetch controller looks up, locks, loads and unlocks them; after a restart with
    a damaged file the prefetch (policy "prefix") stops before that chunk."""
    f = _drive(tmp_path, "manager")
    assert f["loaded_by"] == "KVStoreL2Adapter" and f["stored_blocks"] == 5 and f["l1_deleted"] == 5
    assert f["hits"] == f["l2_hits"] == [0, 1, 2, 3, 4] and f["same"] == [True] * 5
    assert f["pins_after"] == 0  # every lock the controller took, it unlocked
    assert f["restart_hits"] == f["restart_l2_hits"] == [0, 1] and f["restart_same"] == [True] * 2
    assert f["restart_pins_after"] == 0


def test_no_peer_venv_skips_with_one_line(tmp_path):
    assert _peer_ready(tmp_path / "nowhere" / "python") == "no .venv-peers (make peers)"


def test_a_python_without_lmcache_skips_too():
    why = _peer_ready(Path(sys.executable))  # this test venv: no LMCache, by design
    assert why is not None and why.startswith("lmcache not importable")


def test_loaded_through_lmcaches_plugin_loader_with_three_distinct_fds(facts):
    assert facts["is_interface"]
    assert len(set(facts["fds"])) == 3


def test_store_lookup_lock_load_unlock_round_trip(facts):
    assert facts["store_ok"] and facts["store_bytes"] == 6 * 16384
    assert facts["restore_bytes"] == 0  # already stored: nothing written
    assert facts["lookup"] == [0, 1, 2, 3, 4, 5]  # the two absent keys are misses
    assert all(facts["second_query"])  # a result is returned once
    assert facts["pins_locked"] == 6 and facts["status_locked"] == 6  # the lock pins what it found
    assert facts["load"] == [0, 1, 2, 3, 4, 5] and all(facts["bytes_equal"])
    assert facts["pins_unlocked"] == 0
    assert facts["usage"] > 0


def test_a_lookup_with_gaps_and_a_partial_unlock(facts):
    """A lookup pins each run of stored chunks in one call (the NVMe tier reads it at depth); the
    run's pins end with its last chunk's unlock, never before a chunk still locked is loaded."""
    assert facts["lookup_gaps"] == [0, 2, 3, 5] and facts["pins_gaps"] == 4
    assert facts["load_after_partial_unlock"] == [0, 1, 2] and all(facts["gap_bytes_equal"])
    assert facts["pins_partial"] == 4  # keys[1]'s pin is its run's, ended with keys[2]'s unlock
    assert facts["pins_after_gaps"] == 0


def test_another_layout_is_a_miss_and_never_copied(facts):
    assert facts["lookup_other_layout"] == [] and facts["load_other_layout"] == []
    assert facts["other_layout_untouched"]


def test_two_threads(facts):
    assert facts["threads_bad"] == 0 and facts["threads_errs"] == []
    assert facts["lost_completions"] == 0
    assert facts["pins_after_threads"] == 0


def test_files_0600_in_0700_folders(facts):
    assert {m for kind, m in facts["modes"] if kind == "file"} == {0o600}
    assert {m for kind, m in facts["modes"] if kind == "dir"} == {0o700}


def test_restart_reloads_from_nvme_and_a_damaged_file_is_a_miss(facts):
    assert facts["restart_lookup"] == [0, 1, 2, 4, 5]  # chunk 3's file has a flipped byte
    assert facts["restart_load"] == [0, 1, 2, 4, 5]
    assert [facts["restart_equal"][i] for i in (0, 1, 2, 4, 5)] == [True] * 5
    assert facts["damaged_untouched"]  # no wrong bytes in its object
    assert 3 not in facts["unlocked_load"] and facts["unlocked_damaged_untouched"]
    assert facts["restart_pins"] == 0
    assert facts["counted_bad_checksum"] == 1  # a counted miss


def test_models_ranks_and_namespaces_never_share(facts):
    assert facts["other_model"] == [] and facts["other_rank"] == [] and facts["other_namespace"] == []


def test_memory_tags(facts):
    assert [tuple(t) for t in facts["memory_tags"]] == [("DRAM", "LOCAL"), ("STORAGE", "LOCAL")]


def test_bad_adapter_params_name_the_key(facts):
    e = facts["errors"]
    assert "adapter_params.chunk_bytes" in e["chunk"] and "positive integer" in e["chunk"]
    assert "adapter_params.chunk_size" in e["unknown"] and "chunk_bytes" in e["unknown"]
    assert "adapter_params.config" in e["config"]
    assert "tiers.dram.capacity" in e["config_key"]
    assert "adapter_params.chunk_bytes" in e["missing"]


def test_redis_forged_values_are_misses(tmp_path, redis_single):  # noqa: F811
    """The shared tier alone, with an HMAC secret: chunks round trip; a value moved from another
    key, and one with a valid header and checksum but no valid MAC, are misses, counted, and
    their objects keep what they held."""
    f = _drive(tmp_path, "redis", redis_single.url,
               env={"KVSTORE_REDIS_PASSWORD": redis_single.password,
                    "KVSTORE_REMOTE_SECRET": "lmcache-adapter-test-secret-" + "x" * 20})
    assert [tuple(t) for t in f["memory_tags"]] == [("DRAM", "REMOTE")]
    assert f["store_ok"] and f["lookup"] == [0, 1, 2, 3] and f["load"] == [0, 1, 2, 3] and all(f["equal"])
    assert f["forged_lookup"] == [0, 2] and f["forged_load"] == [0, 2]
    assert f["forged_equal"][0] and f["forged_equal"][2] and all(f["forged_untouched"])
    assert f["unauthenticated"] >= 1
