"""Engine-level faults: a real vLLM engine with KVStoreConnector, a fault injected after the
store is filled, then followed through the requests *after* it (the bug this catches: a failed
load whose step stored KV computed over garbage, served to every later request).

One driver process runs one engine (in-process or vLLM's multiprocess executor, DRAM tier on
or off) through every fault, each on its own prompts:

1. fill: turn 0 of three agent sessions that share a system prompt (the fault's own);
2. (DRAM on) a flush workload pushes those blocks out of DRAM: hits must come from files;
3. the fault: damage the files on disk, or arm a failpoint (:mod:`kvstore.failpoints`) through
   a control file the engine's processes read;
4. two append-only follow-up turns of the three sessions (6 requests; vLLM's own prefix cache
   is reset before each batch, so every hit is kvstore's);
5. the heal check: one more turn (twice: the first may meet a damaged file no follow-up met),
   which must be a full kvstore hit again.

Outputs are compared with a reference run of the same requests through vLLM's own prefix cache
(``--reference``, no faults, no resets), and every block left in the fault run's folder with
the reference folder's block under the same key (``poisoned_stores``: a block whose KV differs).

    python -m kvstore.bench.faults.engine_driver --reference --model M --out ref.json --store REF
    python -m kvstore.bench.faults.engine_driver --model M --ref ref.json --ref-store REF --store S --dram 1 \
        [--mp] --out res.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: bench/faults/../..
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from kvstore.bench.common import engine  # noqa: E402
from kvstore.bench.common.fault_files import block_files, damage, poisoned  # noqa: E402
from kvstore.bench.common.ports import free_port  # noqa: E402

BS = 32
MAX_TOKENS = 16
# name -> (what, how): "file" damages files on disk; "fp" arms a failpoint; which modes it applies to
FAULTS: dict[str, dict] = {
    "none": {},  # the control: the same turns with no fault (its recompute is the baseline)
    "payload": {"file": "payload"},
    "header": {"file": "header"},
    "truncated": {"file": "truncated"},
    "replaced": {"file": "replaced"},
    "deleted": {"fp": "store.read=unlink*1"},
    "rewritten": {"fp": "store.read=rewrite*1"},
    "unreadable": {"fp": "nvme.read=eio*2"},
    "dram_slot_lost": {"fp": "store.pin=drop_blocks*1", "dram": True, "hot": True},
    "scatter_error": {"fp": "mover.scatter=raise*1", "hot": True},
    # the scheduler retries a store it could not reach after a back-off (0.1 s, doubled per failure:
    # 0.7 s in all after three closes); the follow-ups (< 0.3 s of a tiny model) all fall in it, and
    # on CI the heal requests did too (heal hit 0, 0): the heal check waits it out ("settle_s")
    "rpc_socket": {"fp": "rpc.serve=close*3", "mp": True, "hot": True, "settle_s": 1.5},
    "tier_shut_down": {"fp": "store.pin=close_store*1", "last": True, "hot": True},
}


def prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(4, 500, size=n)]


def workload(i: int) -> dict:
    """Fault ``i``'s prompts: a system prompt shared by three sessions, and each turn's new text."""
    system = prompt(200, 1000 + i)
    return {"system": system, "user": [[prompt(40 + 8 * s, 2000 + 100 * i + 10 * t + s) for s in range(3)]
                                        for t in range(4)]}


# -- the engine ------------------------------------------------------------------------------------
class Engine(engine.Engine):
    """The engine of one driver: KVStoreConnector (or none) on ``store``, its metrics on ``port``."""

    def __init__(self, model: str, store: str, *, dram_gb: float, mp: bool, port: int | None,
                 connector: bool = True, prefix_caching: bool = True):
        ktc = None
        if connector:
            # the DRAM index holds 80 blocks; 32 more slots (a turn's stores and more) take
            # the victims still being written down, so a turn's stores are not skipped
            head = HEADROOM if dram_gb else "auto"
            # every stored block is loaded, never cut for speed: under load (CI beside another
            # engine) the read rates once made both heal requests "slower_than_recompute" (768
            # tokens), a fair choice that hides whether the cache healed; tests/test_load_or_recompute.py
            # covers that policy
            cfg = engine.connector_config(store, dram_gb=dram_gb, nvme_gb=1, dram={"headroom_blocks": head},
                                          io={"load_only_if_faster": False})
            ktc = engine.kv_transfer({**cfg, "metrics": {"port": port}})
        super().__init__(model, block_size=BS, max_len=4096, kv_transfer=ktc, prefix_caching=prefix_caching, mp=mp)
        self.port = port

    def metrics(self) -> dict[str, float]:
        if not self.port:
            return {}
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, v = line.rpartition(" ")
                try:
                    out[name] = float(v)
                except ValueError:
                    pass
        return out


def store_identity(m: dict) -> tuple[bytes, str] | None:
    for k in m:
        if k.startswith("kvstore_store_info{"):
            root = re.search(r'root="([0-9a-f]+)"', k).group(1)
            ns = re.search(r'namespace="([0-9a-f]+)"', k).group(1)
            return bytes.fromhex(root), ns
    return None


# -- the run ---------------------------------------------------------------------------------------
def faults_for(dram: bool, mp: bool, only: list[str] | None) -> list[str]:
    out = []
    for name, f in FAULTS.items():
        if only and name not in only:
            continue
        if f.get("dram") and not dram or f.get("mp") and not mp:
            continue
        out.append(name)
    return sorted(out, key=lambda n: FAULTS[n].get("last", False))


def flush_prompts() -> list[list[int]]:
    return [prompt(1200, 9000 + i) for i in range(4)]  # 148 blocks: more than the DRAM tier's 80


def run_reference(model: str, store: str, names: list[str]) -> dict:
    """vLLM's own prefix cache on the same requests (no resets); the connector stores clean KV."""
    e = Engine(model, store, dram_gb=DRAM_GB, mp=False, port=None)
    ref: dict = {}
    try:
        for i, name in enumerate(FAULTS):
            if name not in names:
                continue
            w = workload(i)
            prompts = [w["system"] + w["user"][0][s] for s in range(3)]
            turns = []
            for t in range(4):
                outs, _ = e.generate(prompts, MAX_TOKENS, reset=False)
                turns.append({"prompts": prompts, "outputs": outs})
                if t < 3:
                    prompts = [p + o + w["user"][t + 1][s] for s, (p, o) in enumerate(zip(prompts, outs))]
            ref[name] = turns
        e.generate(flush_prompts(), MAX_TOKENS, reset=False)
    finally:
        e.close()
    return ref


HEADROOM = 32
DRAM_GB = (80 + HEADROOM) * 128 * 1024 / 2 ** 30  # 80 blocks of the tiny model's 128 KiB, + headroom


def block_keys(e: "Engine", mp: bool, root: bytes):
    """The keys a prompt's blocks are stored under: the chain keys, or with a hybrid model (in
    vLLM's in-process mode, where its KV cache groups can be read) every group's."""
    from kvstore.keys import chain_keys

    groups = None
    if not mp:
        from kvstore.connectors.vllm.model import kv_groups

        c = e.llm.llm_engine.engine_core.engine_core
        groups, _ = kv_groups(c.vllm_config, c.scheduler.kv_cache_config)

    def keys(p: list[int]) -> list[bytes]:
        base = chain_keys(root, p, BS)
        if groups is None or groups.plain:
            return base
        return [k for g in range(len(groups)) for k in groups.keys(g, base)]
    return keys


def set_failpoints(ctl: str, spec: str) -> None:
    tmp = ctl + ".tmp"
    with open(tmp, "w") as f:
        f.write(spec)
    os.replace(tmp, ctl)
    time.sleep(0.01)  # a new mtime for the readers


def delta(after: dict, before: dict, name: str) -> float:
    """The change of a metric: ``name`` summed over its labels, or one sample ``name{labels}``."""
    def total(d: dict) -> float:
        return d.get(name, 0.0) if "{" in name else sum(v for k, v in d.items() if k.split("{")[0] == name)
    return total(after) - total(before)


def wait_demoted(e: "Engine", timeout: float = 60.0) -> int | None:
    """Wait until no DRAM block is being written down (``kvstore_demoting_blocks`` 0); the
    gauge's last value (None: no metrics)."""
    end = time.monotonic() + timeout
    while True:
        v = e.metrics().get("kvstore_demoting_blocks")
        if v is None or v == 0 or time.monotonic() > end:
            return None if v is None else int(v)
        time.sleep(0.05)


def unsupplied(after: dict, before: dict) -> dict[str, int]:
    """Prompt tokens the engine computed between two metric snapshots, by why kvstore did not supply them."""
    name = "kvstore_engine_unsupplied_tokens_total"
    out = {}
    for k in after:
        if k.startswith(name + "{"):
            d = int(after[k] - before.get(k, 0.0))
            if d:
                out[re.search(r'reason="([a-z_]+)"', k).group(1)] = d
    return out


def mismatches(turn: int, outs: list[list[int]], want: list[list[int]], cached: list[int]) -> list[dict]:
    """Each output that differs from the reference's: where, from which token, and what the
    request hit (a failure names what to look at, not only a count)."""
    out = []
    for s, (a, b) in enumerate(zip(outs, want)):
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append({"turn": turn, "session": s, "first_diff": first, "got": a, "want": b,
                        "cached_tokens": cached[s]})
    return out


def run_faults(model: str, store: str, ref: dict, ref_store: str, *, dram: bool, mp: bool, ctl: str,
               only: list[str] | None = None) -> dict:
    names = faults_for(dram, mp, only)
    port = free_port()
    e = Engine(model, store, dram_gb=DRAM_GB if dram else 0, mp=mp, port=port)
    res: dict = {"mode": "mp" if mp else "inproc", "dram": dram, "faults": {}}
    try:
        m0 = e.metrics()
        ident = store_identity(m0)
        assert ident is not None, "the store's metrics are not served"
        keys_of = block_keys(e, mp, ident[0])

        for name in names:  # 1. fill
            turn0 = ref[name][0]
            outs, c = e.generate(turn0["prompts"], MAX_TOKENS, reset=True)
            res["faults"][name] = {"fill_identical": outs == turn0["outputs"], "fill_cached_tokens": c,
                                   "mismatches": mismatches(0, outs, turn0["outputs"], c)}
        if dram:  # 2. push the fills out of DRAM (demoted to files)
            e.generate(flush_prompts(), MAX_TOKENS, reset=True)
        for name in names:
            f, r = FAULTS[name], res["faults"][name]
            turns = ref[name]
            keys = sorted({k for p in turns[0]["prompts"] + turns[1]["prompts"] for k in keys_of(p)})
            # the fill's blocks are files before they are damaged: no demotion still holds one in DRAM
            # (under load, write-backs lag; a block still in its slot was served from DRAM, and its
            # damaged file met first by the heal request)
            r["demoting_at_fault"] = wait_demoted(e)
            before = e.metrics()
            if "file" in f:  # 3. the fault
                r["files_damaged"] = damage(block_files(store, keys), f["file"])
            elif "fp" in f:
                set_failpoints(ctl, f["fp"])
            wrong, cached = 0, []
            for t in (1, 2):  # 4. follow-ups
                outs, c = e.generate(turns[t]["prompts"], MAX_TOKENS, reset=True)
                wrong += sum(1 for a, b in zip(outs, turns[t]["outputs"]) if a != b)
                r["mismatches"] += mismatches(t, outs, turns[t]["outputs"], c)
                cached.append(c)
            set_failpoints(ctl, "")
            time.sleep(f.get("settle_s", 0.0))
            pre_heal = e.metrics()
            # 5. healed? The heal request may be the first to meet a damaged file on its path (the
            # follow-ups met a good DRAM copy of that block; seen once, under heavy load): it
            # recomputes, and the same request again must then be a full hit
            def heal() -> tuple[int, int]:  # (wrong outputs, hit tokens)
                outs, c = e.generate(turns[3]["prompts"][:1], MAX_TOKENS, reset=True)
                r["mismatches"] += mismatches(3, outs, turns[3]["outputs"][:1], c)
                return int(outs[0] != turns[3]["outputs"][0]), c[0]

            w1, first = heal()
            w2, second = heal()
            wrong += w1 + w2
            # what a run without the fault hits: turn 2's prompt and the output tokens with KV
            full = min((len(turns[2]["prompts"][0]) + MAX_TOKENS - 1) // BS, (len(turns[3]["prompts"][0]) - 1) // BS) * BS
            after = e.metrics()
            bt = BS
            r.update({
                "follow_ups": 8, "wrong_outputs": wrong, "follow_ups_identical": wrong == 0,
                # the most blocks the 8 requests after the fault could load: each failing once at most
                "follow_up_blocks": sum((len(p) - 1) // BS for t in (1, 2) for p in turns[t]["prompts"])
                + 2 * ((len(turns[3]["prompts"][0]) - 1) // BS),
                "cached_tokens": cached + [[first, second]],
                # (the first heal stored its own blocks: the second may hit more than ``full``)
                "healed": second >= full, "heal_hit_tokens": second, "heal_first_hit_tokens": first,
                "heal_full_tokens": full,
                # why the follow-ups' tokens were computed
                "follow_up_unsupplied": unsupplied(pre_heal, before),
                "loads_failed_blocks": int(delta(after, before, 'kvstore_engine_unsupplied_tokens_total'
                                                 '{reason="load_failed"}') // bt),
                "tokens_recomputed": int(delta(after, before, "kvstore_engine_unsupplied_tokens_total")),
                "blocks_stored_again": int(delta(after, before, "kvstore_engine_stored_blocks_total")),
                "stores_skipped_failed_load": int(delta(after, before, "kvstore_engine_store_skipped_blocks_total")),
                "store_errors": int(delta(after, before, "kvstore_engine_store_errors_total")),
                "corrupt_files": int(delta(after, before, "kvstore_corrupt_files_total")),
                "dram_no_slot": int(delta(after, before, "kvstore_tier_skipped_blocks_total")),
                "metrics_seen": bool(after),
                # why the heal request's tokens were computed (a failed heal names its cause)
                "heal_unsupplied": unsupplied(after, pre_heal),
                # calls of the connector's hooks per side (a scheduler in another process: in the plans)
                "hook_calls": {side: int(delta(*({k: v for k, v in d.items() if f'side="{side}"' in k}
                                                 for d in (after, before)), "kvstore_engine_hook_calls_total"))
                               for side in ("scheduler", "worker")},
            })
            if not after:  # the store (and its metrics endpoint) is gone
                r["heal_unsupplied"] = None
                for k in ("loads_failed_blocks", "tokens_recomputed", "blocks_stored_again",
                          "stores_skipped_failed_load", "store_errors", "corrupt_files", "dram_no_slot",
                          "hook_calls"):
                    r[k] = None
            if FAULTS[name].get("last"):
                r["healed"] = None  # the store is gone for good: nothing can hit again
    finally:
        set_failpoints(ctl, "")
        e.close()
    compared, bad, unknown, examples = poisoned(store, ref_store)
    res.update({"blocks_compared": compared, "poisoned_stores": bad, "blocks_not_in_reference": unknown,
                "poisoned_examples": examples,
                "namespaces": sorted(p.name for p in Path(store).glob("kvstore-*")),
                "ref_namespaces": sorted(p.name for p in Path(ref_store).glob("kvstore-*")),
                "corrupt_served": sum(r.get("wrong_outputs", 0) for r in res["faults"].values())})
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--reference", action="store_true")
    p.add_argument("--ref")
    p.add_argument("--ref-store")
    p.add_argument("--dram", type=int, default=1)
    p.add_argument("--mp", action="store_true")
    p.add_argument("--only", default="")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.reference:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        data = run_reference(a.model, a.store, [x for x in a.only.split(",") if x] or list(FAULTS))
    else:
        ctl = os.environ.get("KVSTORE_FAILPOINTS", "")
        assert ctl.startswith("@"), "run with KVSTORE_FAILPOINTS=@<control file> (see kvstore.failpoints)"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.mp else "0"
        with open(a.ref) as f:
            ref = json.load(f)
        data = run_faults(a.model, a.store, ref, a.ref_store, dram=bool(a.dram), mp=a.mp, ctl=ctl[1:],
                          only=[x for x in a.only.split(",") if x] or None)
    with open(a.out, "w") as f:
        json.dump(data, f)
    print("RESULT " + json.dumps(data), flush=True)
    return data


if __name__ == "__main__":
    main()
