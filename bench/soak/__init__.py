"""kvstore bench soak: hours under load (issue 47). vLLM's OpenAI-compatible server with kvstore
(DRAM, NVMe and a Redis tier; ``--node``: attached to a ``kvstore serve`` daemon holding them),
driven for ``--minutes`` by agent sessions, chats that come back after the DRAM TTL and one-off
prompts (bench/soak/workload.py), while faults happen on a schedule (bench/soak/faults.py).

* **Every output checked**: each answer is compared with vLLM's own greedy answer on the same
  tokens (computed first by an engine without kvstore); a difference is a failure, and the
  request is kept in the JSON for replay.
* **Tracked over time and plotted** (bench/soak/watch.py): RSS, threads and fds of each process,
  NVMe files and bytes, Redis keys and memory, DRAM and NVMe blocks, hit rate per tier, TTFT
  p50/p99 and errors; ``soak.png`` and ``soak.json`` in ``--out``.
* **Limits**: a process's RSS, threads or fds whose fitted slope over the second half of the run
  (after its last restart) projects a growth past ``--growth`` of its level (and a floor) fails
  the run; so does a store holding more than its capacity (DRAM and NVMe blocks, NVMe files and
  bytes, Redis keys and memory under its ``maxmemory``), a fault after which no request was
  answered right within ``RECOVER_S``, and p99 TTFT of a fault-free phase above ``--ttft-ratio``
  times the first phase's.

The schedule: the first ``QUIET_SHARE`` of the run has no fault (the TTFT baseline); the faults
follow in order, spread to end by ``1 - QUIET_SHARE`` of it (a fault starts when the one before
it is over); the run lasts until the last fault is over plus the quiet tail, at least ``--minutes``.
A fault's phase lasts until ``SETTLE_S`` after it ended; the rest are the fault-free phases.

    kvstore bench soak --minutes 60 --out bench/results/soak60
    kvstore bench soak --minutes 3 --node --out /tmp/soak
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter

from kvstore.bench.common import harness

QUIET_SHARE = 0.15
SETTLE_S = 30.0  # a fault's phase lasts this long after it ended (caches refill, a restart warms up)
RECOVER_S = 120.0  # a fault after which nothing is answered right this long is not survived
MIN_PHASE_REQUESTS = 30  # a fault-free phase with fewer answers has no p99 of its own
KEEP_WRONG = 20  # wrong answers kept whole in the JSON (all are counted)
BLOCK_BYTES = 128 << 10  # the tiny Llama's block of 32 tokens: 4 layers x K,V x 2 heads x 64 x fp32
FLOORS = {"rss_mb": 64, "threads": 4, "fds": 16}  # the least growth over a run that fails it
PROCESSES = ("server", "engine", "daemon")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="the run's length (longer if the faults need it)")
    p.add_argument("--out", type=harness.folder, default=None, help="folder for soak.json, soak.png and the "
                   "logs (default: a new temporary folder)")
    p.add_argument("--node", action="store_true", help="the engine attaches to a kvstore serve daemon")
    p.add_argument("--redis", choices=("on", "off"), default="on", help="the shared Redis tier")
    p.add_argument("--faults", default="all", help="comma-separated (engine_restart, redis_kill, nvme_delete, "
                   "engine_kill, daemon_kill, disk_full, redis_flush, nvme_damage), all, or none")
    p.add_argument("--concurrency", type=int, default=3, help="requests in flight at once")
    p.add_argument("--agents", type=int, default=6)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--once", type=int, default=200, help="distinct one-off prompts (cycled)")
    p.add_argument("--dram-blocks", type=int, default=96, help="kvstore's DRAM tier, in blocks of 32 tokens")
    p.add_argument("--dram-ttl", type=float, default=20.0, help="the DRAM tier's TTL; chats pause longer")
    p.add_argument("--nvme-mb", type=int, default=96, help="the NVMe tier's capacity")
    p.add_argument("--redis-mb", type=int, default=64, help="Redis's maxmemory (volatile-lru, as in production)")
    p.add_argument("--gpu-blocks", type=int, default=128, help="vLLM's own KV cache, in blocks")
    p.add_argument("--growth", type=float, default=0.25, help="a resource may grow this share of its level "
                   "over one run length (projected from the second half's slope)")
    p.add_argument("--ttft-ratio", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    harness.json_switch(p, "print the JSON instead of the tables")


class Log:
    """Every answer: (end time, kind, TTFT s or None, outcome); the wrong ones kept for replay."""

    def __init__(self):
        self.lock = threading.Lock()
        self.rows: list[tuple[float, str, float | None, str]] = []
        self.wrong: list[dict] = []
        self.errors: Counter = Counter()

    def add(self, t: float, kind: str, ttft: float | None, outcome: str) -> None:
        with self.lock:
            self.rows.append((t, kind, ttft, outcome))
            if outcome not in ("ok", "wrong"):
                self.errors[outcome] += 1

    def window(self, t0: float, t1: float) -> list[tuple]:
        with self.lock:
            return [r for r in self.rows if t0 <= r[0] < t1]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _worker(server, traffic, log: Log, stop: threading.Event, t0: float, out_tokens: int) -> None:
    from kvstore.bench.soak.server import Down

    while not stop.is_set():
        now = time.monotonic()
        it = traffic.next(now)
        if it is None:
            stop.wait(0.05)
            continue
        try:
            ttft, got, whole = server.complete(it.prompt, out_tokens)
            if whole:
                outcome = "ok" if got == it.expect else "wrong"
            else:  # aborted by a stopping server: what came must still be the answer's start
                outcome = "aborted" if got == it.expect[:len(got)] else "wrong"
        except Down:
            ttft, got, outcome = None, None, "down"
        except Exception as e:  # an HTTP error from a live server: a failure of its own kind
            ttft, got, outcome = None, None, f"error: {str(e)[:80]}"
        t = time.monotonic() - t0
        log.add(t, it.kind, ttft, outcome)
        if outcome == "wrong":
            with log.lock:
                if len(log.wrong) < KEEP_WRONG:
                    log.wrong.append({"t": round(t, 1), "request": it.name, "prompt": it.prompt,
                                      "expect": it.expect, "got": got})
        traffic.done(it, time.monotonic())
        if outcome == "down":
            stop.wait(0.5)  # the server is restarting


def _mount(where: str, mb: int) -> str | None:
    """A tmpfs of ``mb`` at ``where`` (root only), else None (the disk fill is a failpoint)."""
    os.makedirs(where, mode=0o700, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m,mode=0700", "kvstore-soak", where],
                       capture_output=True, text=True)
    return where if r.returncode == 0 else None


def _configs(a, tiers: dict, mport: int, name: str) -> tuple[dict, dict | None]:
    """(the connector's extra config, the daemon's config or None)."""
    io = {"load_only_if_faster": False}  # on the tiny CPU model a load costs about a recompute: load every hit
    if a.node:
        daemon = {"tiers": tiers, "mode": "node", "node": {"name": name}, "metrics": {"port": mport}}
        return {"mode": "node", "node": {"name": name}, "io": io}, daemon
    return {"tiers": tiers, "io": io, "metrics": {"port": mport}}, None


def _phases(faults: list[dict], end: float) -> list[tuple[float, float]]:
    """The fault-free stretches: before the first fault, between a fault's settling and the next."""
    out, t = [], 0.0
    for f in faults:
        if f["start"] > t:
            out.append((t, f["start"]))
        t = max(t, f["end"] + SETTLE_S)
    if end > t:
        out.append((t, end))
    return out


def run(a: argparse.Namespace) -> dict:
    from kvstore.bench.common import redis_local
    from kvstore.bench.soak import faults as soak_faults, watch as soak_watch
    from kvstore.bench.common.ports import free_port
    from kvstore.bench.soak.server import Daemon, Server
    from kvstore.bench.soak.workload import Spec, Traffic, reference
    from kvstore.bench.common.tiny_model import build_tiny_llama

    out = a.out or tempfile.mkdtemp(prefix="kvstore-soak-")
    work = tempfile.mkdtemp(prefix="kvstore-soak-work-")
    names = soak_faults.applicable(a.node, a.redis == "on")
    if a.faults == "none":
        names = []
    elif a.faults != "all":
        asked = [f.strip() for f in a.faults.split(",") if f.strip()]
        bad = [f for f in asked if f not in names]
        if bad:
            raise SystemExit(f"--faults: {', '.join(bad)} not one of {', '.join(names)} (with these options)")
        names = asked
    spec = Spec(seed=a.seed, agents=a.agents, chats=a.chats, turns=a.turns, once=a.once,
                chat_pause_s=a.dram_ttl * 1.25)
    model = build_tiny_llama(os.path.join(work, "model"), hidden=256, layers=4, seed=0)
    print(f"kvstore bench soak: vLLM's answers first ({out}/reference.log)", flush=True)
    with open(os.path.join(out, "reference.log"), "wb") as rlog:
        answers = reference(model, spec, os.path.join(work, "reference.json"), log=rlog)

    disk = _mount(os.path.join(work, "disk"), a.nvme_mb * 3 // 2 + 16)  # the tier, its file pool, headers
    nvme = os.path.join(disk or os.path.join(work, "disk"), "store")
    fp_file = os.path.join(work, "failpoints")
    open(fp_file, "w").close()
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVSTORE_FAILPOINTS=f"@{fp_file}")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own layout: its EngineCore a process
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    r = None
    if a.redis == "on":
        pw = secrets.token_urlsafe(16)
        r = redis_local.start(os.path.join(work, "redis"), password=pw, maxmemory=f"{a.redis_mb}mb")
        env.update(KVSTORE_REDIS_PASSWORD=pw, KVSTORE_REMOTE_SECRET=secrets.token_urlsafe(32))
    tiers = {"dram": {"capacity_gb": a.dram_blocks * BLOCK_BYTES / 2**30, "ttl_s": a.dram_ttl},
             "nvme": {"path": nvme, "capacity_gb": a.nvme_mb / 1024, "ttl_s": None}}
    if r is not None:
        tiers["remote"] = {"url": r.url, "timeout_ms": 500}
    mport = free_port()
    connector, dcfg = _configs(a, tiers, mport, f"soak-{secrets.token_hex(4)}")
    daemon = Daemon(dcfg, work, os.path.join(out, "daemon.log"), env) if dcfg else None
    server = Server(model, connector=connector, log_path=os.path.join(out, "server.log"), env=env,
                    # --shutdown-timeout: a SIGTERM drains the requests in flight and lets the
                    # connector write DRAM down (vLLM's default 0 kills the engine at once, and
                    # left the aborted streams open until the client's timeout: docs/design.md)
                    server_args=["--enforce-eager", "--block-size", "32", "--dtype", "float32", "--seed", "0",
                                 "--shutdown-timeout", "60",
                                 "--max-model-len", str(spec.max_len()),
                                 "--num-gpu-blocks-override", str(a.gpu_blocks)])
    rig = soak_faults.Rig(server, r, daemon, nvme, disk, fp_file, a.seed)
    log, track, fault_log = Log(), soak_watch.Track(), []
    stop = threading.Event()
    run_s = a.minutes * 60
    try:
        if daemon:
            daemon.start()
        print(f"kvstore bench soak: the server started in {server.start():.0f} s; {a.minutes:g} min, "
              f"faults: {', '.join(names) or 'none'}", flush=True)
        t0 = time.monotonic()
        traffic = Traffic(spec, answers, t0)
        workers = [threading.Thread(target=_worker, args=(server, traffic, log, stop, t0, spec.output_tokens),
                                    name=f"soak-{i}", daemon=True) for i in range(a.concurrency)]
        for w in workers:
            w.start()

        sample_s = max(2.0, run_s / 400)
        redis_url = r.url.replace("redis://", f"redis://:{r.password}@") if r else None

        def watch() -> None:
            while not stop.is_set():
                t = time.monotonic() - t0
                recent = [x[2] for x in log.window(t - 30, t) if x[3] == "ok"]
                procs = {**server.pids(), **({"daemon": daemon.pid()} if daemon else {})}
                s = soak_watch.sample(procs, nvme_path=nvme, redis_url=redis_url,
                                      metrics_url=f"http://127.0.0.1:{mport}/metrics")
                with log.lock:
                    s.update({"ttft.p50_ms": (_pct(recent, 0.5) or 0) * 1000,
                              "ttft.p99_ms": (_pct(recent, 0.99) or 0) * 1000,
                              "requests.failed": sum(log.errors.values()), "requests.wrong": len(log.wrong),
                              "requests.done": len(log.rows)})
                track.add(t, s)
                stop.wait(sample_s)

        watcher = threading.Thread(target=watch, name="soak-watch", daemon=True)
        watcher.start()
        # the faults run in this thread: a Redis restarted by a thread that ends dies with it
        # (redis_local's PR_SET_PDEATHSIG is the parent *thread's*: a 60-minute run lost its Redis
        # for good when a faults thread ended)
        span = run_s * (1 - 2 * QUIET_SHARE)
        for i, f in enumerate(names):
            at = run_s * QUIET_SHARE + span * i / max(1, len(names))
            while time.monotonic() - t0 < at:
                time.sleep(0.5)
            start = time.monotonic() - t0
            print(f"kvstore bench soak: {start / 60:5.1f} min: {f}", flush=True)
            try:
                detail, ok = soak_faults.FAULTS[f](rig), True
            except Exception as e:  # the fault itself failed (e.g. the server never came back)
                detail, ok = {"error": str(e)[-2000:]}, False
            fault_log.append({"name": f, "start": round(start, 1), "end": round(time.monotonic() - t0, 1),
                              "ran": ok, **detail})
        last_end = fault_log[-1]["end"] if fault_log else 0.0
        end_at = max(run_s, last_end + max(60.0, run_s * QUIET_SHARE))
        while time.monotonic() - t0 < end_at:
            time.sleep(0.5)
        stop.set()
        watcher.join(60)
    finally:
        stop.set()
        for w in locals().get("workers", []):
            w.join(180)
        stopped_clean = server.stop()
        if daemon:
            daemon.stop()
        if r is not None:
            r.stop()
        if disk:
            subprocess.run(["umount", "-l", disk], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)  # the model, vLLM's answers, the NVMe folder
    end = time.monotonic() - t0
    res = _result(a, spec, log, track, fault_log, names, end, stopped_clean)
    res["out"] = out
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump({**res, "track": track.to_json(), "wrong_answers": log.wrong}, f)
    soak_watch.plot(track, os.path.join(out, "soak.png"), marks=[(f["start"], f["name"]) for f in fault_log],
                    title=f"kvstore bench soak: {end / 60:.0f} min, {len(log.rows)} requests, "
                          f"{res['wrong']} wrong")
    return harness.show(a, res, report)


def _result(a, spec, log: Log, track, fault_log: list[dict], names: list[str], end: float, clean: bool) -> dict:
    from kvstore.bench.soak import faults as soak_faults, watch as soak_watch

    problems = []
    rows = log.rows
    wrong = sum(1 for r in rows if r[3] == "wrong")
    if wrong:
        problems.append(f"{wrong} wrong answers (the first {len(log.wrong)} kept in soak.json's wrong_answers)")
    for f in fault_log:  # survived: ran, and a right answer came within RECOVER_S of its end
        after = [r for r in rows if r[0] >= f["end"]]
        first_ok = next((r[0] for r in after if r[3] == "ok"), None)
        f["recovered_s"] = None if first_ok is None else round(first_ok - f["end"], 1)
        near = [r for r in after if r[0] < f["end"] + 60]
        f["after_60s"] = {"answers": len(near), "ok": sum(r[3] == "ok" for r in near),
                          "wrong": sum(r[3] == "wrong" for r in near)}
        if not f["ran"] or f["recovered_s"] is None or f["recovered_s"] > RECOVER_S:
            problems.append(f"fault {f['name']} not survived: {f.get('error') or 'no right answer after it'}")
        if f.get("clean") is False:
            problems.append(f"fault {f['name']}: the server did not stop within 120 s of SIGTERM")
    missing = [n for n in names if n not in {f["name"] for f in fault_log}]
    if missing:
        problems.append(f"faults never ran: {', '.join(missing)}")
    phases = []
    for t0, t1 in _phases(fault_log, end):
        ts = [r[2] for r in log.window(t0, t1) if r[2] is not None and r[3] == "ok"]
        phases.append({"from_s": round(t0), "to_s": round(t1), "answers": len(ts),
                       "p50_ms": round((_pct(ts, 0.5) or 0) * 1000, 1), "p99_ms": round((_pct(ts, 0.99) or 0) * 1000, 1)})
    base = phases[0]["p99_ms"] if phases and phases[0]["answers"] >= MIN_PHASE_REQUESTS else None
    for ph in phases:
        ph["ratio"] = round(ph["p99_ms"] / base, 2) if base and ph["answers"] >= MIN_PHASE_REQUESTS else None
        if ph["ratio"] is not None and ph["ratio"] > a.ttft_ratio:
            problems.append(f"p99 TTFT {ph['p99_ms']} ms in the fault-free phase {ph['from_s']}-{ph['to_s']} s: "
                            f"{ph['ratio']}x the first phase's (limit {a.ttft_ratio}x)")
    since = {}
    for f in fault_log:
        for prefix in soak_faults.RESETS.get(f["name"], ()):
            since[prefix] = f["end"]
    procs = [n for n in track.names() if n.split(".", 1)[0] in PROCESSES]
    lim = soak_watch.limits(track, procs, run_s=end, rel=a.growth, floor=FLOORS,
                            since={n: t for n in procs for p, t in since.items() if n.startswith(p)})
    lim += capped(track, caps(a))
    problems += [f"{x['name']} grows: {x['reason']}" for x in lim if not x["ok"]]
    if not clean:
        problems.append("the server did not stop within 120 s of SIGTERM at the end")
    last = track.rows[-1][1] if track.rows else {}
    for what, name in (("the engine", "engine.rss_mb"), ("Redis", "redis.keys" if a.redis == "on" else None),
                       ("the daemon", "daemon.rss_mb" if a.node else None)):
        if name and name not in last:  # everything the faults took down is up again at the end
            problems.append(f"{what} is not up at the end of the run")
    hits = _hits(track)
    kinds = Counter(r[1] for r in rows)
    return {"minutes": round(end / 60, 1), "requests": len(rows), "by_kind": dict(kinds), "wrong": wrong,
            "failed": dict(log.errors), "hit_rate": hits, "faults": fault_log, "phases": phases, "limits": lim,
            "problems": problems}


def caps(a) -> dict[str, float]:
    """What each store may hold at most: its configured capacity (a cache refilling after a fault
    climbs, as a leak does, so its slope says nothing; a level past its capacity does). The NVMe
    folder also holds a write's temporary file and the tier's own files; Redis counts its own
    memory beside the values (a value: the block and a header)."""
    from kvstore.tiers.nvme.pool import default_max_files

    nvme_blocks = a.nvme_mb * 2**20 // BLOCK_BYTES
    pool = default_max_files(BLOCK_BYTES, a.nvme_mb * 2**20)  # recycled files kept for the next writes
    redis_blocks = a.redis_mb * 2**20 // BLOCK_BYTES
    return {"dram.blocks": a.dram_blocks, "nvme.blocks": nvme_blocks, "nvme.files": nvme_blocks + pool + 16,
            "nvme.mb": (nvme_blocks + pool + 16) * BLOCK_BYTES / 2**20 * 1.04,
            "redis.keys": redis_blocks * 1.1 + 64, "redis.used_mb": a.redis_mb * 1.1 + 4}


def capped(track, limit: dict[str, float]) -> list[dict]:
    """A row per store series: its highest level against its capacity."""
    rows = []
    for name, cap in limit.items():
        ts, vs = track.series(name)
        if not len(vs):
            continue
        top = float(max(vs))
        rows.append({"name": name, "slope_per_min": None, "projected": None, "median": float(statistics.median(vs)),
                     "limit": cap, "ok": top <= cap, "reason": f"at most {top:g}, capacity {cap:g}"})
    return rows


def _hits(track) -> dict:
    """kvstore's share of the prompt tokens the engine did not hold, by tier, over the whole run
    (counters summed over the engine's lives: a restart starts them at 0)."""
    def total(name: str) -> float:
        ts, vs = track.series(name)
        s, prev = 0.0, 0.0
        for v in vs:
            s += v - prev if v >= prev else v  # a restart: the counter began again
            prev = v
        return s

    need = total("prompt_tokens") - total("local_hit_tokens")
    tiers = {n.split(".", 1)[1] for n in track.names() if n.startswith("served.")}
    return {t: round(float(total(f"served.{t}") / need), 3) if need > 0 else None for t in sorted(tiers)}


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def report(res: dict) -> str:
    out = [f"kvstore bench soak: {res['minutes']} min, {res['requests']} answers {res['by_kind']}, "
           f"{res['wrong']} wrong, failed: {res['failed'] or 'none'}; hit rate by tier {res['hit_rate']}", "",
           "| fault | at min | took s | right answer again after s | next 60 s: answers / ok / wrong | detail |",
           "|---|---|---|---|---|---|"]
    for f in res["faults"]:
        detail = {k: v for k, v in f.items() if k not in ("name", "start", "end", "ran", "recovered_s", "after_60s")}
        a = f["after_60s"]
        out.append(f"| {f['name']} | {f['start'] / 60:.1f} | {f['end'] - f['start']:.0f} | {f['recovered_s']} | "
                   f"{a['answers']} / {a['ok']} / {a['wrong']} | {detail} |")
    out += ["", "| fault-free phase (s) | answers | p50 TTFT ms | p99 TTFT ms | p99 / first |", "|---|---|---|---|---|"]
    out += [f"| {p['from_s']}-{p['to_s']} | {p['answers']} | {p['p50_ms']} | {p['p99_ms']} | {p['ratio']} |"
            for p in res["phases"]]
    out += ["", "| resource | slope / min (2nd half) | projected over the run | median | limit | ok |",
            "|---|---|---|---|---|---|"]
    out += [f"| {x['name']} | {_g(x.get('slope_per_min'))} | {_g(x.get('projected'))} | {_g(x.get('median'))} | "
            f"{_g(x.get('limit'))} | {'yes' if x['ok'] else 'NO: ' + x['reason']} |" for x in res["limits"]]
    out += ["", "problems: " + ("; ".join(res["problems"]) if res["problems"] else "none"),
            f"plot and JSON: {res['out']}/soak.png, soak.json"]
    return "\n".join(out)


def main(argv=None) -> dict:
    return harness.main(__name__, argv)
