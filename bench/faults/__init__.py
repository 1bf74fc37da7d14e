"""``kvstore bench faults``: the fault suite, long form (the short form runs in CI: tests/test_faults.py).

One module per fault family (``bench/faults/families/<family>.py``), one function each; each returns a dict
of figures:

1. ``crash``       — a writer process (puts with evictions, DRAM demotions, reads) killed with
   SIGKILL at random points, over and over; after each restart every indexed block reads back
   byte-identical, no temporary or orphan file is left, the index matches the folder.
2. ``corruption``  — byte flips, truncation, zero length, wrong magic/version/fingerprint/key/
   codec, a huge declared length, files that are not ours, symlinks, folders and FIFOs where
   files should be; at read time and at the start-up scan, inline and xattr headers. Every
   case must be a counted miss: nothing served, no exception, no hang.
3. ``fuzz``        — the file-header parser (and the tier's checks behind it) on random and
   mutated headers; then fuzzed headers written into real block files, read and scanned.
4. ``disk_full``   — the NVMe tier on a small tmpfs (``mount -t tmpfs -o size=``, needs root)
   filled far past capacity: writes fail soft, the tier shrinks, the store keeps serving.
5. ``sharing``     — two processes on one NVMe folder at once (one deletes what the other
   reads, both write, both reopen to see the other's files): no wrong read, no lost write.
6. ``churn``       — a long put/get/prefetch/evict/expire/reopen run; RSS, open files and
   threads sampled (drift = last sample minus the sample after warm-up).
7. ``bad_input``   — bad configs, wrong types, negative sizes, unusable or unsafe folders,
   malformed traces: each must be refused with a clear error (ConfigError/ValueError/TraceError).
8. ``permissions`` — the folders the other families left: files 0600, folders 0700, no
   symlink; bad keys refused; no pickling in the core.
9. ``engine``      — real vLLM engines (bench/faults/engine_driver.py): every way a load can fail,
   injected after the store is filled and followed through the requests after it; DRAM tier
   off and on, in-process and (long run) multiprocess. ``corrupt_served`` (follow-ups whose
   output differs from vLLM's own prefix cache) and ``poisoned_stores`` (blocks left in the
   store whose KV differs from a clean run's under the same key) must both be 0.
10. ``trust``      — the trust boundaries of issue 29, tried as an outsider would: hostile Redis
   servers (a trickler, 2 MiB replies sent slowly, silence, wrong handshakes) against a lookup,
   a load, a store and close() under timeout_ms 200; forged values in a real redis-server beside
   a store with KVSTORE_REMOTE_SECRET; another user against the RPC socket (its folder, its
   peer, its handles); every bad setting of the issue; a LIST and a folder planted where blocks
   belong; and those of issue 45: zstd frames that declare 4 GiB or 1 TiB or lie about their
   size, in Redis and in block files, and an engine with another secret beside a fleet's blocks.
   ``trust_stall_ratio`` (the longest call over timeout_ms) must stay <= 1.5;
   ``trust_escaped``, ``trust_forged_served``, ``trust_hijacks_accepted``,
   ``trust_bad_settings_accepted``/``_unclear``, ``trust_heal_failures``,
   ``trust_bombs_unbounded``, ``trust_cross_secret_deleted`` and ``trust_cross_secret_lost`` must be 0.

``--quick`` runs the CI-sized version. ``--json PATH`` writes every figure (the headline ones
at the top level: crash_cycles, corrupt_reads_served, fuzz_inputs, fuzz_crashes,
disk_full_engine_errors, shared_wrong_reads, rss_drift_mb, fd_drift, and the trust family's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: bench/faults/../..
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from kvstore.bench.common import harness  # noqa: E402
from kvstore.bench.common.report import markdown_table  # noqa: E402
from kvstore.bench.faults.families.bad_input import BAD_CONFIGS, BAD_TRACE_LINES, bad_input  # noqa: E402
from kvstore.bench.faults.families.churn import churn, proc_sample  # noqa: E402
from kvstore.bench.faults.families.common import (FP, Hang, MountError, _child_cmd, alarm, block_of, child_main,  # noqa: E402
                                                  corrupt_total, key_of, make_config, open_store, read_check, tier_vs_folder,
                                                  tmpfs, walk_cache)
from kvstore.bench.faults.families.corruption import (_rewrite, corruption, craft_header, damages, get_header,  # noqa: E402
                                                      set_header)
from kvstore.bench.faults.families.crash import crash, verify_recovery  # noqa: E402
from kvstore.bench.faults.families.disk_full import disk_full  # noqa: E402
from kvstore.bench.faults.families.fuzz import fuzz  # noqa: E402
from kvstore.bench.faults.families.permissions import permissions  # noqa: E402
from kvstore.bench.faults.families.sharing import sharing  # noqa: E402
from kvstore.bench.faults.families.trust import trust  # noqa: E402

__all__ = ["BAD_CONFIGS", "BAD_TRACE_LINES", "FAMILIES", "FP", "HEADLINE", "REPO", "SIZES", "Hang",
           "MountError", "_child_cmd", "_rewrite", "add_args", "alarm", "bad_input", "block_of",
           "child_main", "churn", "corrupt_total", "corruption", "craft_header", "crash", "damages",
           "disk_full", "fuzz", "get_header", "key_of", "main", "make_config", "open_store", "permissions",
           "problems_of", "proc_sample", "read_check", "run", "set_header", "sharing", "tier_vs_folder",
           "tmpfs", "trust", "verify_recovery", "walk_cache"]

SIZES = {
    "quick": {"crash_cycles": 12, "corruption_rounds": 1, "fuzz_inputs": 20_000, "fuzz_files": 300,
              "disk_full_mb": 3, "sharing_ops": 400, "churn_ops": 1_500, "trust_rounds": 1},
    "long": {"crash_cycles": 220, "corruption_rounds": 6, "fuzz_inputs": 300_000, "fuzz_files": 3_000,
             "disk_full_mb": 8, "sharing_ops": 4_000, "churn_ops": 15_000, "trust_rounds": 5},
}
HEADLINE = ("crash_cycles", "corrupt_reads_served", "fuzz_inputs", "fuzz_crashes", "disk_full_engine_errors",
            "shared_wrong_reads", "rss_drift_mb", "fd_drift", "corrupt_served", "poisoned_stores",
            "trust_longest_stall_s", "trust_stall_ratio", "trust_escaped", "trust_forged_served",
            "trust_hijacks_accepted", "trust_bad_settings_accepted", "trust_bad_settings_unclear",
            "trust_heal_failures", "trust_bombs_unbounded", "trust_cross_secret_deleted", "trust_cross_secret_lost")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the CI-sized run (seconds, not minutes)")
    harness.output_args(p, plots=False, json_help="write every figure as JSON")
    p.add_argument("--dir", default=None, type=harness.folder, help="parent folder for the scratch folders (default: a temp folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=None, help="comma-separated families (crash,corruption,fuzz,disk_full,"
                   "sharing,churn,bad_input,permissions,engine,trust)")


FAMILIES = ("crash", "corruption", "fuzz", "disk_full", "sharing", "churn", "bad_input", "permissions", "engine",
            "trust")


def run(a: argparse.Namespace) -> dict:
    size = SIZES["quick" if a.quick else "long"]
    only = set(a.only.split(",")) if a.only else set(FAMILIES)
    unknown = only - set(FAMILIES)
    if unknown:
        raise SystemExit(f"unknown families: {', '.join(sorted(unknown))}")
    figures: dict = {}
    families: dict = {}
    timings: dict = {}
    work = tempfile.mkdtemp(prefix="kvstore-faults-", dir=a.dir)
    os.chmod(work, 0o700)
    steps = {"crash": size["crash_cycles"], "corruption": 2 * size["corruption_rounds"], "fuzz": 100,
             "disk_full": 1, "sharing": 1, "churn": size["churn_ops"], "bad_input": 1, "permissions": 1,
             "engine": 3 if a.quick else 5, "trust": 4}
    total = sum(v for k, v in steps.items() if k in only)
    import logging

    kvlog = logging.getLogger("kvstore")
    old_level = kvlog.level
    kvlog.setLevel(logging.ERROR)  # every fault is logged as a warning: thousands of them
    try:
        with harness.Progress(total, "bench faults") as bar:
            def go(name: str, fn: Callable[[], dict]) -> None:
                if name not in only:
                    return
                bar.label(name)
                t0 = time.perf_counter()
                families[name] = fn()
                timings[name] = round(time.perf_counter() - t0, 1)

            adv = bar.advance
            go("crash", lambda: crash(Path(work, "crash"), cycles=size["crash_cycles"], seed=a.seed, advance=adv))
            go("corruption", lambda: corruption(Path(work, "corruption"), rounds=size["corruption_rounds"],
                                                seed=a.seed, advance=adv))
            go("fuzz", lambda: fuzz(Path(work, "fuzz"), inputs=size["fuzz_inputs"], files=size["fuzz_files"],
                                    seed=a.seed, advance=lambda n: adv(n * 100 // max(1, size["fuzz_inputs"]))))
            go("disk_full", lambda: disk_full(Path(work, "disk_full"), size_mb=size["disk_full_mb"], seed=a.seed))
            go("sharing", lambda: sharing(Path(work, "sharing"), ops=size["sharing_ops"], seed=a.seed, advance=adv))
            go("churn", lambda: churn(Path(work, "churn"), ops=size["churn_ops"], seed=a.seed, advance=adv))
            go("bad_input", lambda: bad_input(Path(work, "bad_input"), advance=adv))
            # (not corruption/fuzz: their folders hold the foreign files planted on purpose)
            go("permissions", lambda: permissions([Path(work, f) for f in ("crash", "sharing", "churn")],
                                                  advance=adv))
            from kvstore.bench.faults.families.engine import family as engine_family

            os.makedirs(Path(work, "engine"), mode=0o700, exist_ok=True)
            go("engine", lambda: engine_family(str(Path(work, "engine")), quick=a.quick, advance=adv))
            go("trust", lambda: trust(Path(work, "trust"), rounds=size["trust_rounds"], seed=a.seed, advance=adv))
    finally:
        kvlog.setLevel(old_level)
        shutil.rmtree(work, ignore_errors=True)
    for fam in families.values():
        figures.update({k: v for k, v in fam.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    figures["corrupt_reads_served"] = sum(families.get(f, {}).get(k, 0) for f, k in (
        ("crash", "crash_wrong_reads"), ("corruption", "corrupt_reads_served"), ("fuzz", "fuzz_served"),
        ("fuzz", "fuzz_wrong_reads")))
    data = {"mode": "quick" if a.quick else "long", "sizes": size, **{k: figures.get(k) for k in HEADLINE},
            "figures": figures, "families": families, "seconds": timings}
    data["problems"] = problems_of(data)
    return harness.report(a, data, render)


def render(data: dict) -> str:
    """Every figure per family, the engine family's matrix, the seconds each family took, the problems."""
    families, timings, problems = data["families"], data["seconds"], data["problems"]
    rows = [{"family": f, "figure": k, "value": v} for f, fam in families.items() for k, v in fam.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)]
    rows += [{"family": "all", "figure": k, "value": data["figures"].get(k)} for k in HEADLINE]
    out = [markdown_table(rows, ["family", "figure", "value"]), ""]
    if families.get("engine", {}).get("rows"):  # per fault, per engine mode
        er = families["engine"]["rows"]
        out += [markdown_table(er, list(er[0])), ""]
    if families.get("trust", {}).get("stall_rows"):  # the longest of each call per hostile server
        tr = families["trust"]["stall_rows"]
        out += [markdown_table(tr, list(tr[0])), ""]
    if families.get("trust", {}).get("bomb_rows"):  # each hostile zstd frame, per tier
        br = [{**r, "peak": round(r["peak"] / 2**20, 2)} for r in families["trust"]["bomb_rows"]]
        out += [markdown_table(br, ["where", "frame", "seconds", "peak", "why"]), ""]
    out.append(markdown_table([{"family": f, "seconds": s} for f, s in timings.items()], ["family", "seconds"]))
    out.append("\nno problems found" if not problems else "\nPROBLEMS:\n" + "\n".join(f"- {p}" for p in problems))
    return "\n".join(out)


def problems_of(data: dict) -> list[str]:
    """What a run found that must not happen (empty: all good)."""
    fam = data["families"]
    out = []
    zero = {"crash": ["crash_wrong_reads", "crash_failed_reads", "crash_orphans", "crash_tmp_after_recovery",
                      "crash_index_missing_files", "crash_writer_errors", "crash_perm_violations",
                      "crash_scan_corrupt"],
            "corruption": ["corrupt_reads_served", "corrupt_crashes", "corrupt_hangs"],
            "fuzz": ["fuzz_crashes", "fuzz_hangs", "fuzz_served", "fuzz_wrong_reads"],
            "disk_full": ["disk_full_engine_errors", "disk_full_wrong_reads", "disk_full_tmp_left"],
            "sharing": ["shared_wrong_reads", "shared_lost_writes", "shared_errors", "shared_orphans",
                        "shared_tmp_left"],
            "churn": ["churn_wrong_reads", "churn_errors"],
            "permissions": ["perm_violations", "perm_key_path_escapes"],
            "engine": ["corrupt_served", "poisoned_stores", "engine_not_healed"],
            "trust": ["trust_escaped", "trust_forged_served", "trust_hijacks_accepted", "trust_bad_settings_accepted",
                      "trust_bad_settings_unclear", "trust_heal_failures", "trust_bombs_unbounded",
                      "trust_cross_secret_deleted", "trust_cross_secret_lost", "trust_cross_secret_served"]}
    for f, keys in zero.items():
        for k in keys:
            if f in fam and fam[f].get(k):
                out.append(f"{f}: {k} = {fam[f][k]}")
    if "corruption" in fam:
        c = fam["corruption"]
        if c["corrupt_uncounted_cases"]:
            out.append(f"corruption: not counted: {c['corrupt_uncounted_cases']}")
        if c["corrupt_misses"] != c["corrupt_cases"] - c["corrupt_crashes"] - c["corrupt_hangs"]:
            out.append("corruption: a damaged block was not a miss")
    if "disk_full" in fam and "skipped" not in fam["disk_full"]:
        d = fam["disk_full"]
        if not d["disk_full_events"] or d["disk_full_nvme_capacity_after"] >= d["disk_full_nvme_capacity_configured"]:
            out.append("disk_full: the tier did not shrink")
    if "bad_input" in fam and fam["bad_input"]["bad_input_unclear"]:
        out.append(f"bad_input: {[c['case'] for c in fam['bad_input']['bad_input_unclear']]}")
    if "permissions" in fam and fam["permissions"]["perm_unpickling_sites"]:
        out.append(f"permissions: unpickling in {fam['permissions']['perm_unpickling_sites']}")
    if "trust" in fam:
        out += trust_problems(fam["trust"])
    if "churn" in fam and fam["churn"].get("fd_drift", 0) > 0:
        out.append(f"churn: fd_drift = {fam['churn']['fd_drift']}")
    return out


def trust_problems(t: dict) -> list[str]:
    """The trust family's bounds, and the checks that would have proved nothing."""
    out = []
    if t["trust_stall_ratio"] > 1.5:
        out.append(f"trust: {t['trust_longest_stall_call']} took {t['trust_longest_stall_s']} s, "
                   f"{t['trust_stall_ratio']} x timeout_ms (at most 1.5)")
    if t["trust_stall_calls_reached"] < t["trust_stall_calls"]:
        out.append("trust: a timed call never reached its hostile server")
    if "trust_forged_tried" in t:
        if not t["trust_forged_control_served"]:
            out.append("trust: no forged value was served even without a secret: the check proves nothing")
        if t["trust_honest_served"] < t["trust_honest_written"]:
            out.append("trust: honest values were not served to a store with the same secret")
    if "trust_cross_secret_blocks" in t:
        if not t["trust_cross_secret_blocks"]:
            out.append("trust: the cross-secret check stored nothing: it proves nothing")
        if t["trust_rotation_served"] < t["trust_cross_secret_blocks"]:
            out.append("trust: an engine rotating to a new secret did not serve the previous secret's blocks")
    if not t["trust_hijacks_tried"] or not t["trust_bad_settings_tried"] or not t["trust_heal_tried"] \
            or not t.get("trust_bombs_tried", 1):
        out.append("trust: a part of the family tried nothing")
    return out


def main(argv=None) -> dict:
    return harness.main(__name__, argv)
