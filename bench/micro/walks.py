"""The walk of one save and one load through the real code, counted at run time (issue 30, Measure).

    python bench/micro/walks.py [--blocks 4,8] [--remote auto|on|off] [--repeat 2] [--json OUT] [--detail]

It runs unchanged on any checkout whose venv imports that checkout's kvstore (its entry points:
kvstore.offload's ``acquire_shared``/``StepRunner``/``Planner``/``LocalClient``, ``KVStore``).

A worker rig as the connector builds it (kvstore.offload: ``acquire_shared``, ``StepRunner``,
``LocalClient``, ``Planner``; a numpy engine cache in vLLM's CPU layout, 16-token blocks of 8 KiB)
over a store with DRAM and NVMe (a temporary folder), and again with a Redis tier (a private
``redis-server`` on loopback) when one is installed. ``io_threads`` is 1 for NVMe and Redis, so
the threads are the same from run to run. Untraced first: DRAM filled (a save must demote
victims), then one save and one load of other blocks (lazy set-up).

* save: ``StepRunner.save(plan)`` of one prefill's full blocks (the plan made untraced by the planner),
  with the config's ``io.async_saves``: ``begin_store`` on the entry thread, the gather and
  ``end_store`` on the copy thread, the victims' demotion (and the Redis write-through) on the
  I/O pools; counted until every background job is done.
* load: a request whose blocks are on NVMe only (Redis only, with the remote tier): the stages
  ``Planner.track``, ``lookup``, ``allocated`` (the pin), ``build_step``, ``StepRunner.load`` (read,
  scatter, ``end_load``; on the load thread with ``io.async_loads``), then, once the load thread
  is idle, ``StepRunner.get_finished``. A load's counts can differ by a few between walks: a victim of
  its promotion may still be on its way to NVMe when the load ends (``Demotions.release``).

Counting (``sys.setprofile`` on the entry thread during the stages only, ``threading.setprofile``
on every thread the rig starts; waiting for background work is not counted):

* ours: a frame whose code's file lies in the imported ``kvstore`` package or in the
  ``connectors`` package; only the ``call`` and ``return`` events of our frames count;
* functions: distinct code objects of ours entered (file, qualified name, first line), lambdas
  included; a comprehension or generator expression is part of the function holding it (its frame
  is skipped); files: their distinct files; threads: the threads that entered one;
* returns to a file already left: per thread, the sequence of files of the innermost frame of ours
  (the stack's top, other code skipped), consecutive repeats collapsed; each element that occurred
  before in its thread's sequence counts one (A B A C A: 2); summed over threads. A thread already
  inside our code when the walk starts (the copy-job threads wait in kvstore code) starts its
  sequence with that file. Loops over blocks repeat their crossings, so this grows with --blocks;
* main line: for each stage on the entry thread and for each other thread, the deepest stack of
  our frames (the first at that depth), outermost first; the main line is their union: its
  distinct functions and files, and every call on those stacks from one file into another,
  classified by floors. ``downward only``: every such call goes down (or is a hook);
* crossings: the distinct calls (caller function, callee function) between two files of ours,
  on every thread (the whole walk, side branches such as the gather included), by floors.

Floors, from the imports of every file of ours (``ast``: at module level, in functions and under
``TYPE_CHECKING`` alike), as ``farm-studio look`` counts them but per file: floor 1 imports nothing
of ours, a file stands one floor above the highest it imports, files importing each other in a
loop share a floor. A package ``__init__.py`` under 40 lines that defines nothing is a face, not a
file: an import through it is an import of the file that defines the name. A call to a method is
judged by the file of the most basic class of ours that has it (the interface the caller names:
``Tier.write`` for ``NvmeTier.write``); a base class calling its own abstract hook, run by a
subclass in another file, is a ``hook``. Else a call into a lower floor is ``down``; into a
higher one ``up`` (into a file that imports the caller, a mixin calling the class assembled from
it, a callback such as a job run by a queue); same floor ``level`` (a loop, or no import between).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from kvstore import kvcopy
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.offload import LocalClient, StepRunner, Planner, acquire_shared, release_shared

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from walkcount import Tracer, dispatch, floors, our_roots  # noqa: E402

try:  # the public face after issue 30; kvstore.store before it
    from kvstore import KVStore
except ImportError:  # pragma: no cover - depends on the checkout
    from kvstore.store import KVStore

BS = 16
LAYERS, HEADS, HEAD = 1, 2, 64  # fp16: 8 KiB blocks
DRAM_SLOTS = 64


# -- the rig --------------------------------------------------------------------------------------

def tokens(tag: str, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(sum(map(ord, tag)) * 7919 + n).integers(1, 32000, n)]


def start_redis(folder: str):
    try:  # bench/common/ after issue 48; bench/ before it
        from kvstore.bench.common.ports import free_port
    except ImportError:  # pragma: no cover - depends on the checkout
        from kvstore.bench.ports import free_port

    port = free_port()
    p = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port), "--bind",
                          "127.0.0.1", "--dir", folder, "--save", "", "--appendonly", "no", "--logfile", "redis.log"],
                         stdout=subprocess.DEVNULL)
    for _ in range(250):
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            return p, f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.02)
    p.kill()
    raise RuntimeError("redis-server did not start")


def walk(tmp: str, blocks: int, redis_url: str | None, roots: list[str], floor: dict) -> dict:
    caches = [np.zeros((4 * blocks + 64, HEADS, BS, 2 * HEAD), np.float16) for _ in range(LAYERS)]
    layout = kvcopy.KVLayout.from_vllm(caches)
    bb = layout.block_bytes
    fp = ModelFingerprint(model="walks", dtype="float16", block_size=BS, num_layers=LAYERS, num_kv_heads=HEADS,
                          head_size=HEAD, layout=f"walks.{layout.packing}")

    def config(nvme: str):
        tiers = {"dram": {"capacity_gb": DRAM_SLOTS * bb / 2 ** 30, "ttl_s": None},
                 "nvme": {"path": nvme, "capacity_gb": 1, "ttl_s": None, "io_threads": 1}}
        if redis_url:
            tiers["remote"] = {"url": redis_url, "io_threads": 1, "timeout_ms": 5000}
        return from_dict({"tiers": tiers, "io": {"load_only_if_faster": False}})

    def rows(n: int) -> np.ndarray:
        return np.random.default_rng(n).integers(0, 255, (n, bb), dtype=np.uint8)

    n_tok = blocks * BS + 1  # a prompt of `blocks` full blocks and one token
    cfg = config(os.path.join(tmp, "nvme"))
    # the blocks to load: NVMe only (a first store, closed: persisted), or Redis only (its NVMe elsewhere)
    first = KVStore(config(os.path.join(tmp, "elsewhere")) if redis_url else cfg, block_bytes=bb, fingerprint=fp,
                    block_tokens=BS)
    for tag in ("warm-load", "load"):
        ks = chain_keys(first.root, tokens(tag, n_tok), BS)
        assert first.put(ks, rows(len(ks))) == len(ks)
    first.close()
    threading.setprofile(dispatch)  # every thread the rig starts (silent until a tracer starts)
    shared = acquire_shared(f"walks-{os.getpid()}-{os.path.basename(tmp)}/tp0", cfg, fp, bb, BS)
    try:
        store = shared.store
        store.wait_ready(60)
        ks = chain_keys(store.root, tokens("fill", DRAM_SLOTS * BS), BS)  # a full DRAM: a save demotes
        store.put(ks, rows(len(ks)))
        io = cfg.io
        mover = StepRunner(shared, async_saves=io.async_saves, async_loads=io.async_loads)
        mover.register(caches, layout)
        planner = Planner(LocalClient(shared), fp, BS, prefetch=True, async_loads=io.async_loads,
                          async_saves=io.async_saves)
        ids = list(range(blocks + 1))

        def quiet():
            if shared.jobs is not None:
                shared.jobs.wait_idle(60)
            store.flush()

        def save_plan(tag: str):
            st = planner.track(tag, tokens(tag, n_tok), n_tok)
            planner.allocated(st, planner.lookup(st, 0))
            return planner.build_step([(tag, ids, 0)], [], {tag: n_tok})

        def load(tag: str, call):
            st = call(planner.track, tag, tokens(tag, n_tok), n_tok, None, [], arrival=0.0, session="")
            hit = call(planner.lookup, st, 0)
            assert hit == blocks * BS, (tag, hit)
            call(planner.allocated, st, hit, ids if st.load_async else None)
            plan = call(planner.build_step, [] if st.load_async else [(tag, ids, hit)], [], {})
            call(mover.load, plan)
            quiet()
            call(mover.get_finished, set(), plan)
            assert not mover.take_load_errors()

        mover.save(save_plan("warm-save"))  # lazy set-up, untraced
        quiet()
        load("warm-load", lambda f, *a, **k: f(*a, **k))
        quiet()
        where = "remote" if redis_url else "nvme"
        m = store.contains_prefix(chain_keys(store.root, tokens("load", n_tok), BS), record=False)
        assert m.num_blocks == blocks and set(m.tiers) == {where}, m  # the scenario is the one named
        out = {}
        plan = save_plan("save")
        tracer = Tracer(roots).start()
        tracer.call(mover.save, plan)
        quiet()
        out["save"] = tracer.report(floor)
        assert store.contains_prefix(plan.stores[0].keys, record=False).num_blocks == blocks
        tracer = Tracer(roots).start()
        load("load", tracer.call)
        quiet()
        out["load"] = tracer.report(floor)
        mover.close()
        return out
    finally:
        threading.setprofile(None)
        release_shared(shared)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="4,8", help="full blocks saved and loaded (16 tokens each), comma list")
    ap.add_argument("--remote", choices=["auto", "on", "off"], default="auto",
                    help="also walk with a Redis tier (a private redis-server; auto: when one is installed)")
    ap.add_argument("--repeat", type=int, default=2, help="walks per setting, each in a fresh rig (counts must agree)")
    ap.add_argument("--json", help="write every count, line and sequence here")
    ap.add_argument("--detail", action="store_true", help="print each main line's calls between files")
    a = ap.parse_args(argv)
    roots = our_roots()
    floor = floors(roots)
    remote = [False] + ([True] if a.remote == "on" or (a.remote == "auto" and (
        shutil.which("redis-server") or os.path.exists("/usr/bin/redis-server"))) else [])
    res: dict = {"kvstore": os.path.dirname(roots[0]), "walks": {}}
    keys = ("functions", "files", "threads", "returns")
    for blocks in (int(x) for x in a.blocks.split(",")):
        for r in remote:
            runs = []
            for _ in range(a.repeat):
                tmp = tempfile.mkdtemp(prefix="kvstore-walks-")
                proc = None
                try:
                    url = None
                    if r:
                        proc, url = start_redis(tmp)
                    runs.append(walk(tmp, blocks, url, roots, floor))
                finally:
                    if proc is not None:
                        proc.terminate()
                        proc.wait(10)
                    shutil.rmtree(tmp, ignore_errors=True)
            for w in ("save", "load"):
                out = runs[0][w]
                out["repeats"] = {k: [x[w][k] for x in runs] for k in keys}
                out["repeats"].update({f"main_line_{k}": [x[w]["main_line"][k] for x in runs] for k in keys[:2]})
                out["repeats"]["crossings"] = [x[w]["crossings"]["calls"] for x in runs]
                res["walks"][f"{w}, {'DRAM+NVMe+Redis' if r else 'DRAM+NVMe'}, {blocks} blocks"] = out
    print(f"kvstore at {res['kvstore']}: functions, files and threads of kvstore/connectors code (bench/micro/walks.py); "
          f"{a.repeat} walks each, a range where they differ (races with the background jobs); the calls' "
          "directions are those of the first walk")
    print("| walk | functions | files | threads | returns to a file left | main line: functions / files "
          "| its calls down / hook / level / up | crossings | their calls down / hook / level / up |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for name, r in res["walks"].items():
        ml, x, rep = r["main_line"], r["crossings"], r["repeats"]
        v = {k: str(min(n)) if min(n) == max(n) else f"{min(n)}-{max(n)}" for k, n in rep.items()}
        print(f"| {name} | {v['functions']} | {v['files']} | {v['threads']} | {v['returns']} | "
              f"{v['main_line_functions']} / {v['main_line_files']} | {ml['calls']['down']} / {ml['calls']['hook']} / "
              f"{ml['calls']['level']} / {ml['calls']['up']} | {v['crossings']} | {x['kinds']['down']} / "
              f"{x['kinds']['hook']} / {x['kinds']['level']} / {x['kinds']['up']} |")
    if a.detail:
        for name, r in res["walks"].items():
            print(f"\n{name}: main line's calls between files")
            print("\n".join("  " + m for m in r["main_line"]["moves"]))
            print(f"{name}: crossings that do not go down")
            print("\n".join("  " + m for m in r["crossings"]["moves"] if "(down," not in m))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
