"""``kvstore bench agent``: a synthetic agent workload replayed through a real KVStore (no model).

Sessions share a system prompt and tool schemas; turns are append-only; think times are heavy
tailed (seconds for the agent loop, minutes to hours for humans); see ``bench/workload.py``.
Every request, in time order, on a virtual clock (the store's injected clock jumps from one
request to the next, so hours of traffic replay in seconds):

1. ``contains_prefix(keys)`` — the lookup the connector's scheduler makes (records the store's
   metrics: hit tokens per tier, miss tokens by reason);
2. ``get`` of the matched blocks — the load (refreshes recency and TTL, promotes NVMe hits to
   DRAM); the bytes are checked against what was stored;
3. ``put`` of the prompt's remaining full blocks — what the connector saves after the prefill.

Blocks are small synthetic payloads (4 KiB by default, derived from the key): this measures
policy, not bandwidth. Capacities are those of the real model, in blocks: a tier of
``capacity_gb`` holds ``capacity_gb / (kv_bytes_per_token * block_tokens)`` blocks, and bytes
held are reported at the real model's size.

Reported, per variant (organic and replay-heavy side by side) and over time: token-weighted hit
rate per tier; hits split into *replay* (the identical prompt — same key list — was seen
before) and *genuine* prefix reuse; misses by reason (never stored, evicted for capacity,
expired by TTL, diverged after N stored blocks); prefill tokens saved (a hit never covers the
last token: vLLM computes at least one); bytes held per tier. ``--ttl-sweep`` replays the first
variant for several TTLs (NVMe TTL with DRAM as configured; DRAM TTL with no NVMe tier).
``--trace-out`` writes the generated workload as a trace for ``kvstore tune``; ``--trace``
replays a recorded trace instead of generating one.

Parameters: ``configs/bench_agent.yaml`` (``--config``), then ``--set dotted.key=value``, then
the named flags.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import yaml

from bench import workload as wl
from bench.report import markdown_table, progress, write_json
from kvstore.config import GiB, from_dict
from kvstore.memory import alloc_aligned
from kvstore.metrics import MISS_REASONS
from kvstore.store import KVStore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "configs", "bench_agent.yaml")

BENCH_DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "workload": {},
    "variants": {"organic": {}, "replay_heavy": {"replay_prob": 0.3, "rerun_frac": 1.0}},
    "model": {"kv_bytes_per_token": 131072},  # 7B fp16: 2 (K,V) x 32 layers x 8 KV heads x 128 x 2 bytes
    "bench": {"payload_bytes": 4096, "windows": 24, "ttl_sweep": [60, 300, 900, 3600, 14400, 86400],
              "verify": True},
    "store": {"tiers": {"dram": {"capacity_gb": 8, "ttl_s": 600, "policy": "lru_shared"},
                        "nvme": {"capacity_gb": 200, "ttl_s": 86400, "policy": "lru"}}},
}
TOP_KEYS = set(BENCH_DEFAULTS)


# -- config ------------------------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help=f"bench YAML (default: {os.path.relpath(DEFAULT_CONFIG)} if present)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any YAML key, dotted, value in YAML (e.g. workload.sessions=50, "
                        "store.tiers.dram.ttl_s=null); repeatable")
    p.add_argument("--sessions", type=int, default=None, help="organic sessions (workload.sessions)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=None, help="compress every time by this factor")
    p.add_argument("--variants", default=None, help="comma list of variants to run (default: all in the config)")
    p.add_argument("--ttl-sweep", default=None, help="comma list of TTLs in seconds ('' or 'none' = no sweep)")
    p.add_argument("--dram-gb", type=float, default=None)
    p.add_argument("--dram-ttl", default=None, help="seconds, or null")
    p.add_argument("--nvme-gb", type=float, default=None)
    p.add_argument("--nvme-ttl", default=None, help="seconds, or null")
    p.add_argument("--payload-bytes", type=int, default=None, help="synthetic bytes stored per block")
    p.add_argument("--windows", type=int, default=None, help="time windows in the over-time report")
    p.add_argument("--no-verify", action="store_true", help="skip checking the bytes of every hit")
    p.add_argument("--trace", default=None, help="replay this recorded JSONL trace instead of generating")
    p.add_argument("--trace-out", default=None, help="write each generated variant's trace (JSONL) here "
                   "(variants after the first get .<variant> before the extension)")
    p.add_argument("--dir", default=None, help="parent folder for the NVMe tier's files (default: /dev/shm when "
                   "there is one: this bench measures policy, not disk speed; give a disk folder to include it)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--plots", default=None, help="write PNG plots into this folder")


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = d
    for k in parts[:-1]:
        nxt = node.get(k)
        if not isinstance(nxt, dict):
            nxt = node[k] = {}
        node = nxt
    node[parts[-1]] = value


def _ttl(v: str) -> float | None:
    return None if str(v).strip().lower() in ("null", "none", "inf", "") else float(v)


def resolve(a: argparse.Namespace) -> dict:
    """The bench parameters: built-in defaults < YAML < --set < named flags."""
    path = a.config if a.config is not None else (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    data: dict = {}
    if path:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise SystemExit(f"{path}: expected a YAML mapping")
    for item in a.set or []:
        if "=" not in item:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        _set_dotted(data, k.strip(), yaml.safe_load(v))
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise SystemExit(f"bench agent config: unknown top-level keys {sorted(unknown)}; known: {sorted(TOP_KEYS)}")
    cfg = wl.merged(BENCH_DEFAULTS, {k: v for k, v in data.items() if k != "variants"})
    if "variants" in data:  # a config's variants replace the built-in ones
        cfg["variants"] = dict(data["variants"] or {}) or {"organic": {}}
    flags = {"sessions": a.sessions, "time_scale": a.time_scale}
    for k, v in flags.items():
        if v is not None:
            cfg["workload"][k] = v
    if a.seed is not None:
        cfg["seed"] = a.seed
    tiers = cfg["store"].setdefault("tiers", {})
    for tier, gb, ttl in (("dram", a.dram_gb, a.dram_ttl), ("nvme", a.nvme_gb, a.nvme_ttl)):
        t = tiers.setdefault(tier, {})
        if gb is not None:
            t["capacity_gb"] = gb
        if ttl is not None:
            t["ttl_s"] = _ttl(ttl)
    if a.payload_bytes is not None:
        cfg["bench"]["payload_bytes"] = a.payload_bytes
    if a.windows is not None:
        cfg["bench"]["windows"] = a.windows
    if a.no_verify:
        cfg["bench"]["verify"] = False
    if a.ttl_sweep is not None:
        s = a.ttl_sweep.strip().lower()
        cfg["bench"]["ttl_sweep"] = [] if s in ("", "none") else [_ttl(x) for x in s.split(",") if x.strip()]
    if a.variants:
        want = [v.strip() for v in a.variants.split(",") if v.strip()]
        missing = [v for v in want if v not in cfg["variants"]]
        if missing:
            raise SystemExit(f"unknown variants {missing}; the config has {list(cfg['variants'])}")
        cfg["variants"] = {v: cfg["variants"][v] for v in want}
    cfg["workload"].setdefault("seed", cfg["seed"])
    if a.seed is not None:
        cfg["workload"]["seed"] = a.seed
    pb = int(cfg["bench"]["payload_bytes"])
    if pb <= 0 or pb % 16:
        raise SystemExit(f"payload_bytes must be a positive multiple of 16, got {pb}")
    from_dict(cfg["store"])  # validate the store section (public schema) early, with its own messages
    return cfg


# -- the replay --------------------------------------------------------------------------------

def payload(keys: Sequence[bytes], nbytes: int) -> np.ndarray:
    """Deterministic block bytes: the key repeated (so any hit can be checked without a copy kept)."""
    k = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 16)
    return np.ascontiguousarray(np.tile(k, (1, nbytes // 16)))


def _store_config(store: Mapping, *, payload_bytes: int, kv_block_bytes: int | None, folder: str,
                  nvme_entry_bytes: int | None = None) -> tuple[dict, dict]:
    """The store section with the bench's folder and (when kv_block_bytes is given) capacities in
    blocks of the real model, expressed in synthetic bytes. Returns (config dict, blocks per tier)."""
    cfg = from_dict(store)
    from kvstore import fileformat as ff

    d = wl.merged(cfg.to_dict(), {"tiers": {"nvme": {"path": folder}}, "metrics": {"port": None}, "trace_path": None})
    blocks = {}
    for name, tcfg in (("dram", cfg.tiers.dram), ("nvme", cfg.tiers.nvme)):
        if kv_block_bytes:
            n = tcfg.capacity_bytes // kv_block_bytes
            if name == "dram":
                eb = ff.round_up(payload_bytes)
            else:
                eb = nvme_entry_bytes or ff.file_bytes(payload_bytes)
            d["tiers"][name]["capacity_gb"] = n * eb / GiB
        else:
            n = None
        blocks[name] = n
    return d, blocks


def _open_store(store: Mapping, *, block_tokens: int, payload_bytes: int, kv_block_bytes: int | None, folder: str,
                clock: Callable[[], float]) -> tuple[KVStore, dict]:
    d, blocks = _store_config(store, payload_bytes=payload_bytes, kv_block_bytes=kv_block_bytes, folder=folder)
    fp = wl.ModelFingerprint(model=f"bench-agent-{os.getpid()}-{time.perf_counter_ns()}", block_size=block_tokens)
    s = KVStore(from_dict(d), block_bytes=payload_bytes, fingerprint=fp, block_tokens=block_tokens, clock=clock)
    if s.nvme is not None and kv_block_bytes and blocks["nvme"] is not None:
        # the NVMe entry size depends on where the header lives (xattr or inline): size it exactly
        want = blocks["nvme"] * s.nvme.entry_bytes
        if s.nvme.capacity_bytes != want:
            s.close(persist=False)
            d, blocks = _store_config(store, payload_bytes=payload_bytes, kv_block_bytes=kv_block_bytes,
                                      folder=folder, nvme_entry_bytes=s.nvme.entry_bytes)
            s = KVStore(from_dict(d), block_bytes=payload_bytes, fingerprint=fp, block_tokens=block_tokens,
                        clock=clock)
    s.wait_ready()  # the whole DRAM pool, as configured, from the first request
    return s, blocks


def default_dir() -> str | None:
    """tmpfs when available (file creation on a real disk dominates the run time otherwise)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class VirtualClock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.origin = self.t = float(t)

    def __call__(self) -> float:
        return self.t


def replay(requests: Sequence[wl.Request], store: Mapping, *, block_tokens: int, payload_bytes: int = 4096,
           kv_block_bytes: int | None = None, windows: int = 24, verify: bool = True, folder: str | None = None,
           advance: Callable[[], None] | None = None) -> dict:
    """Replay ``requests`` (time order) through a fresh KVStore built from ``store`` (public schema).

    Returns totals, per-window series, miss reasons (from the store's own metrics), bytes held,
    and ``checks`` (accounting identities that must hold exactly).
    """
    own = folder is None
    tmp = tempfile.mkdtemp(prefix="kvstore-bench-agent-") if own else folder
    clock = VirtualClock()
    t0 = requests[0].t if requests else 0.0
    s, blocks = _open_store(store, block_tokens=block_tokens, payload_bytes=payload_bytes,
                            kv_block_bytes=kv_block_bytes, folder=os.path.join(tmp, "nvme"), clock=clock)
    bt = block_tokens
    n = len(requests)
    max_blocks = max((len(r.keys) for r in requests), default=1)
    _mm, flat = alloc_aligned(max(1, max_blocks) * payload_bytes)
    out = flat.reshape(max(1, max_blocks), payload_bytes)
    cols = {k: np.zeros(n, np.int64) for k in ("lookup", "hit_dram", "hit_nvme", "saved", "prompt", "replay",
                                               "diverged_at", "below_min")}
    miss_by_reason = {r: np.zeros(n, np.int64) for r in MISS_REASONS}
    times = np.array([r.t - t0 for r in requests], dtype=np.float64)
    seen: set[tuple[int, bytes]] = set()
    bounds = sorted({int(round(x)) for x in np.linspace(0, n, max(1, windows) + 1)})
    ends = set(bounds[1:])
    every = max(1, n // 256)  # bytes held are sampled this often (peaks), and at every window end
    held: list[dict] = []
    bad_bytes = lost = 0
    wall = time.perf_counter()
    try:
        for i, r in enumerate(requests):
            clock.t = clock.origin + (r.t - t0)
            keys = list(r.keys)
            cols["prompt"][i] = r.prompt_tokens
            m = s.contains_prefix(keys, num_tokens=r.prompt_tokens)
            if not keys:
                cols["below_min"][i] = r.prompt_tokens
            else:
                ident = (len(keys), keys[-1])  # a chain key hashes the whole prefix: the last one names the list
                is_replay = ident in seen
                seen.add(ident)
                cols["replay"][i] = is_replay
                cols["lookup"][i] = len(keys) * bt
                cols["hit_dram"][i] = m.tiers.count("dram") * bt
                cols["hit_nvme"][i] = m.tiers.count("nvme") * bt
                hit = m.num_blocks * bt
                cols["saved"][i] = min(hit, (r.prompt_tokens - 1) // bt * bt)
                if m.miss_reason is not None:
                    miss_by_reason[m.miss_reason][i] = (len(keys) - m.num_blocks) * bt
                    if m.miss_reason == "diverged":
                        cols["diverged_at"][i] = m.num_blocks
                k = m.num_blocks
                if k:
                    got = s.get(keys[:k], out[:k], session=r.session)
                    if got != k:
                        lost += k - got
                    if verify and got and not np.array_equal(out[:got], payload(keys[:got], payload_bytes)):
                        bad_bytes += 1
                if k < len(keys):
                    s.put(keys[k:], payload(keys[k:], payload_bytes))
            if i + 1 in ends or (i + 1) % every == 0:
                held.append({"t": float(clock.t - clock.origin), "request": i + 1,
                             **{f"{t.name}_blocks": len(t) for t in s.tiers}})
            if advance is not None:
                advance()
        wall = time.perf_counter() - wall
        mv = s.metrics.value
        metrics = {
            "hit_tokens": {t: mv("kvstore_lookup_hit_tokens_total", tier=t) for t in ("dram", "nvme")},
            "lookup_tokens": mv("kvstore_lookup_tokens_total"),
            "miss_tokens": {r: mv("kvstore_lookup_miss_tokens_total", reason=r) for r in MISS_REASONS},
            "evictions": {t: mv("kvstore_tier_evicted_blocks_total", tier=t) for t in ("dram", "nvme")},
            "expirations": {t: mv("kvstore_tier_expired_blocks_total", tier=t) for t in ("dram", "nvme")},
            "demotions": mv("kvstore_demoted_blocks_total"),
            "promotions": mv("kvstore_promoted_blocks_total"),
        }
    finally:
        s.close(persist=False)
        if own:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)

    kvb = kv_block_bytes or payload_bytes
    for h in held:
        for t in ("dram", "nvme"):
            h[f"{t}_gib"] = h.get(f"{t}_blocks", 0) * kvb / GiB
    tot = {k: int(v.sum()) for k, v in cols.items() if k != "diverged_at"}
    hits = tot["hit_dram"] + tot["hit_nvme"]
    replay_hits = int((cols["hit_dram"] + cols["hit_nvme"])[cols["replay"] == 1].sum())
    misses = {r: int(v.sum()) for r, v in miss_by_reason.items()}
    misses["below_min"] = 0  # prompts without a full block are counted apart (tot["below_min"])
    lookup = tot["lookup"]
    div = cols["diverged_at"][miss_by_reason["diverged"] > 0]

    def frac(x: float, d: float) -> float:
        return float(x) / d if d else 0.0

    win = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b <= a:
            continue
        sl = slice(a, b)
        lk = int(cols["lookup"][sl].sum())
        hd, hn = int(cols["hit_dram"][sl].sum()), int(cols["hit_nvme"][sl].sum())
        rh = int((cols["hit_dram"][sl] + cols["hit_nvme"][sl])[cols["replay"][sl] == 1].sum())
        w = {"t_start_s": float(times[a]), "t_end_s": float(times[b - 1]), "requests": b - a, "lookup_tokens": lk,
             "hit_rate": frac(hd + hn, lk), "dram_hit_rate": frac(hd, lk), "nvme_hit_rate": frac(hn, lk),
             "replay_hit_rate": frac(rh, lk), "genuine_hit_rate": frac(hd + hn - rh, lk),
             "prefill_saved": frac(cols["saved"][sl].sum(), cols["prompt"][sl].sum()),
             "miss": {r: frac(v[sl].sum(), lk) for r, v in miss_by_reason.items() if r != "below_min"}}
        win.append(w)
    at_end = {h["request"]: h for h in held}
    for w, b in zip(win, [b for a, b in zip(bounds[:-1], bounds[1:]) if b > a]):
        w.update({k: v for k, v in at_end[b].items() if k.endswith("_gib") or k.endswith("_blocks")})
    peak = {t: max((h.get(f"{t}_gib", 0.0) for h in held), default=0.0) for t in ("dram", "nvme")}
    mean = {t: float(np.mean([h.get(f"{t}_gib", 0.0) for h in held])) if held else 0.0 for t in ("dram", "nvme")}
    res = {
        "requests": n,
        "replay_requests": tot["replay"],
        "prompt_tokens": tot["prompt"],
        "lookup_tokens": lookup,
        "hit_tokens": hits,
        "hit_tokens_dram": tot["hit_dram"],
        "hit_tokens_nvme": tot["hit_nvme"],
        "replay_hit_tokens": replay_hits,
        "genuine_hit_tokens": hits - replay_hits,
        "hit_rate": frac(hits, lookup),
        "dram_hit_rate": frac(tot["hit_dram"], lookup),
        "nvme_hit_rate": frac(tot["hit_nvme"], lookup),
        "replay_hit_rate": frac(replay_hits, lookup),
        "genuine_hit_rate": frac(hits - replay_hits, lookup),
        "miss_tokens": misses,
        "miss_share": {r: frac(v, lookup) for r, v in misses.items()},
        "below_min_tokens": tot["below_min"],
        "diverged_at_block_median": float(np.median(div)) if div.size else None,
        "prefill_saved_tokens": tot["saved"],
        "prefill_saved": frac(tot["saved"], tot["prompt"]),
        "peak_gib": peak,
        "mean_gib": mean,  # over samples evenly spaced in requests
        "final_gib": {t: (held[-1].get(f"{t}_gib", 0.0) if held else 0.0) for t in ("dram", "nvme")},
        "capacity_blocks": blocks,
        "duration_s": float(times[-1]) if n else 0.0,
        "wall_s": wall,
        "windows": win,
        "store_metrics": metrics,
    }
    res["checks"] = {
        "replay_plus_genuine_eq_hits": replay_hits + (hits - replay_hits) == hits and 0 <= replay_hits <= hits,
        "hits_plus_misses_eq_lookup": hits + sum(misses.values()) == lookup,
        "hits_match_store_metrics": all(int(metrics["hit_tokens"][t]) == tot[f"hit_{t}"] for t in ("dram", "nvme")),
        "misses_match_store_metrics": all(int(metrics["miss_tokens"][r]) == misses[r]
                                          for r in MISS_REASONS if r != "below_min")
        and int(metrics["miss_tokens"]["below_min"]) == tot["below_min"],
        "lookup_matches_store_metrics": int(metrics["lookup_tokens"]) == lookup,
        "bytes_verified": bool(verify) and bad_bytes == 0,
        "no_lost_hits": lost == 0,
    }
    return res


# -- the command ---------------------------------------------------------------------------------

def _variant_requests(cfg: dict, variant: str) -> list[wl.Request]:
    return wl.generate(wl.merged(cfg["workload"], cfg["variants"][variant] or {}))


def _trace_path(base: str, i: int, variant: str) -> str:
    if i == 0:
        return base
    root, ext = os.path.splitext(base)
    return f"{root}.{variant}{ext or '.jsonl'}"


def run(a: argparse.Namespace) -> dict:
    cfg = resolve(a)
    b = cfg["bench"]
    payload_bytes, windows, verify = int(b["payload_bytes"]), int(b["windows"]), bool(b["verify"])
    sweep = [None if x is None else float(x) for x in (b.get("ttl_sweep") or [])]
    kv_per_token = int(cfg["model"]["kv_bytes_per_token"])
    # the workload
    if a.trace:
        reqs, bt = wl.from_trace(a.trace)
        inputs = {"trace": reqs}
    else:
        bt = int(wl.check_params(cfg["workload"])["block_tokens"])
        inputs = {v: _variant_requests(cfg, v) for v in cfg["variants"]}
    kv_block_bytes = kv_per_token * bt
    traces = {}
    if a.trace_out and not a.trace:
        for i, (v, reqs) in enumerate(inputs.items()):
            p = _trace_path(a.trace_out, i, v)
            wl.write_trace(reqs, p, bt)
            traces[v] = p
    first = next(iter(inputs))
    sweep_runs = []
    for ttl in sweep:
        sweep_runs.append(("nvme_ttl", ttl))
    for ttl in sweep:
        sweep_runs.append(("dram_only_ttl", ttl))
    total = sum(len(r) for r in inputs.values()) + len(sweep_runs) * len(inputs[first])
    parent = a.dir or default_dir()
    results: dict[str, dict] = {}
    sweep_rows: list[dict] = []
    bar, task = progress(total, "bench agent")
    with bar:
        for v, reqs in inputs.items():
            bar.update(task, description=f"bench agent: {v}")
            with tempfile.TemporaryDirectory(prefix="kvstore-bench-agent-", dir=parent) as d:
                results[v] = replay(reqs, cfg["store"], block_tokens=bt, payload_bytes=payload_bytes,
                                    kv_block_bytes=kv_block_bytes, windows=windows, verify=verify, folder=d,
                                    advance=lambda: bar.advance(task))
        for series, ttl in sweep_runs:
            bar.update(task, description=f"bench agent: TTL sweep {series} {ttl}")
            store = wl.merged(cfg["store"], {})
            tiers = store.setdefault("tiers", {})
            if series == "nvme_ttl":
                tiers.setdefault("nvme", {})["ttl_s"] = ttl
            else:
                tiers.setdefault("dram", {})["ttl_s"] = ttl
                tiers.setdefault("nvme", {})["capacity_gb"] = 0
            with tempfile.TemporaryDirectory(prefix="kvstore-bench-agent-", dir=parent) as d:
                r = replay(inputs[first], store, block_tokens=bt, payload_bytes=payload_bytes,
                           kv_block_bytes=kv_block_bytes, windows=1, verify=False, folder=d,
                           advance=lambda: bar.advance(task))
            sweep_rows.append({"series": series, "variant": first, "ttl_s": ttl, "hit_rate": r["hit_rate"],
                               "dram_hit_rate": r["dram_hit_rate"], "nvme_hit_rate": r["nvme_hit_rate"],
                               "prefill_saved": r["prefill_saved"], "expired_share": r["miss_share"]["expired"],
                               "evicted_share": r["miss_share"]["evicted"],
                               "peak_dram_gib": r["peak_gib"]["dram"], "peak_nvme_gib": r["peak_gib"]["nvme"],
                               "mean_dram_gib": r["mean_gib"]["dram"], "mean_nvme_gib": r["mean_gib"]["nvme"],
                               "wall_s": r["wall_s"]})
    data = {
        "params": cfg,
        "block_tokens": bt,
        "kv_block_bytes": kv_block_bytes,
        "workload": {v: wl.summary(r) for v, r in inputs.items()},
        "variants": results,
        "ttl_sweep": sweep_rows,
        "traces": traces,
    }
    print(render(data))
    write_json(a.json, data)
    if a.plots:
        plot(data, a.plots)
    return data


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _ttl_name(t: float | None) -> str:
    if t is None:
        return "none"
    for unit, s in (("h", 3600), ("min", 60)):
        if t >= s and t % s == 0:
            return f"{int(t // s)} {unit}"
    return f"{t:g} s"


def render(data: dict) -> str:
    st = data["params"]["store"]["tiers"]
    d, n = st.get("dram", {}), st.get("nvme", {})
    lines = [f"Agent workload through the store (virtual clock; {data['block_tokens']}-token blocks of "
             f"{data['kv_block_bytes'] / 2**20:.1f} MiB at the model's size; DRAM {d.get('capacity_gb')} GiB "
             f"TTL {_ttl_name(d.get('ttl_s'))} {d.get('policy', 'lru')}, NVMe {n.get('capacity_gb')} GiB TTL "
             f"{_ttl_name(n.get('ttl_s'))}). Hit rates are token-weighted over the full-block tokens looked up; "
             "prefill saved is over all prompt tokens.", ""]
    rows = []
    for v, r in data["variants"].items():
        w = data["workload"][v]
        rows.append({"variant": v, "requests": r["requests"], "sessions": w["sessions"],
                     "replays": f"{r['replay_requests']} ({_pct(r['replay_requests'] / max(1, r['requests']))})",
                     "prompt_mtok": r["prompt_tokens"] / 1e6, "hours": r["duration_s"] / 3600,
                     "hit": _pct(r["hit_rate"]), "dram": _pct(r["dram_hit_rate"]), "nvme": _pct(r["nvme_hit_rate"]),
                     "replay": _pct(r["replay_hit_rate"]), "genuine": _pct(r["genuine_hit_rate"]),
                     "saved": _pct(r["prefill_saved"]), "peak_dram": r["peak_gib"]["dram"],
                     "peak_nvme": r["peak_gib"]["nvme"], "ok": all(r["checks"].values())})
    lines.append(markdown_table(rows, ["variant", "requests", "sessions", "replays", "prompt_mtok", "hours", "hit",
                                       "dram", "nvme", "replay", "genuine", "saved", "peak_dram", "peak_nvme", "ok"],
                                ["variant", "requests", "sessions", "replayed prompts", "prompt Mtok", "hours",
                                 "hit rate", "DRAM", "NVMe", "replay hits", "genuine hits", "prefill saved",
                                 "peak DRAM GiB", "peak NVMe GiB", "checks"]))
    lines += ["", "Misses by reason (share of looked-up tokens; 'diverged' = matched N stored blocks, then new "
              "tokens: for append-only turns mostly the turn's new content):", ""]
    mrows = []
    for v, r in data["variants"].items():
        ms = r["miss_share"]
        mrows.append({"variant": v, **{k: _pct(ms[k]) for k in ("never_stored", "evicted", "expired", "diverged",
                                                                  "corrupt")},
                      "div_at": r["diverged_at_block_median"], "below": r["below_min_tokens"]})
    lines.append(markdown_table(mrows, ["variant", "never_stored", "evicted", "expired", "diverged", "corrupt",
                                        "div_at", "below"],
                                ["variant", "never stored", "evicted (capacity)", "expired (TTL)", "diverged",
                                 "corrupt", "diverged at block (median)", "tokens below one block"]))
    if data["ttl_sweep"]:
        lines += ["", f"TTL sweep ({data['ttl_sweep'][0]['variant']}): NVMe TTL with DRAM as configured, and DRAM "
                  "TTL with no NVMe tier:", ""]
        srows = [{**r, "ttl": _ttl_name(r["ttl_s"]), "hit": _pct(r["hit_rate"]), "dram": _pct(r["dram_hit_rate"]),
                  "nvme": _pct(r["nvme_hit_rate"]), "saved": _pct(r["prefill_saved"]),
                  "exp": _pct(r["expired_share"]), "ev": _pct(r["evicted_share"])} for r in data["ttl_sweep"]]
        lines.append(markdown_table(srows, ["series", "ttl", "hit", "dram", "nvme", "saved", "exp", "ev",
                                            "mean_dram_gib", "peak_dram_gib", "mean_nvme_gib", "peak_nvme_gib"],
                                    ["series", "TTL", "hit rate", "DRAM", "NVMe", "prefill saved", "expired",
                                     "evicted", "mean DRAM GiB", "peak DRAM GiB", "mean NVMe GiB",
                                     "peak NVMe GiB"]))
    return "\n".join(lines)


def plot(data: dict, folder: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    paths = []
    vs = list(data["variants"])
    fig, axes = plt.subplots(2, len(vs), figsize=(6 * len(vs), 7), squeeze=False, sharex="col")
    for j, v in enumerate(vs):
        w = data["variants"][v]["windows"]
        x = [(q["t_start_s"] + q["t_end_s"]) / 2 / 3600 for q in w]
        ax = axes[0][j]
        ax.plot(x, [100 * q["hit_rate"] for q in w], "k-o", ms=3, label="total")
        ax.plot(x, [100 * q["dram_hit_rate"] for q in w], "-", label="DRAM")
        ax.plot(x, [100 * q["nvme_hit_rate"] for q in w], "-", label="NVMe")
        ax.plot(x, [100 * q["replay_hit_rate"] for q in w], "--", label="replay hits")
        ax.plot(x, [100 * q["genuine_hit_rate"] for q in w], ":", label="genuine hits")
        ax.set_ylim(0, 100)
        ax.set_ylabel("token hit rate (%)")
        ax.set_title(f"{v}: hit rate over time (overall {100 * data['variants'][v]['hit_rate']:.1f}%)")
        ax.legend(fontsize=8)
        ax = axes[1][j]
        ax.plot(x, [q.get("dram_gib", 0) for q in w], label="DRAM")
        ax.plot(x, [q.get("nvme_gib", 0) for q in w], label="NVMe")
        ax.set_xlabel("virtual time (h)")
        ax.set_ylabel("bytes held (GiB, model size)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = os.path.join(folder, "agent_hit_rate.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    if data["ttl_sweep"]:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        ax2 = ax.twinx()
        big = 10 * max(r["ttl_s"] for r in data["ttl_sweep"] if r["ttl_s"] is not None) if any(
            r["ttl_s"] is not None for r in data["ttl_sweep"]) else 1e6
        for series, label, col in (("nvme_ttl", "NVMe TTL (DRAM as configured)", "C0"),
                                   ("dram_only_ttl", "DRAM TTL, no NVMe tier", "C1")):
            rows = [r for r in data["ttl_sweep"] if r["series"] == series]
            if not rows:
                continue
            xs = [r["ttl_s"] if r["ttl_s"] is not None else big for r in rows]
            ax.plot(xs, [100 * r["hit_rate"] for r in rows], "-o", color=col, label=f"hit rate: {label}")
            key = "peak_nvme_gib" if series == "nvme_ttl" else "peak_dram_gib"
            ax2.plot(xs, [r[key] for r in rows], "--", color=col, alpha=0.6,
                     label=f"peak {'NVMe' if series == 'nvme_ttl' else 'DRAM'} GiB")
        ax.set_xscale("log")
        ax.set_xlabel("TTL (s, log)")
        ax.set_ylabel("token hit rate (%)")
        lo = min(100 * r["hit_rate"] for r in data["ttl_sweep"])
        ax.set_ylim(max(0.0, 10 * math.floor(lo / 10) - 10), 100)
        ax2.set_ylabel("peak bytes held (GiB, model size)")
        ax.set_title(f"Hit rate vs TTL ({data['ttl_sweep'][0]['variant']} workload)")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower right")
        fig.tight_layout()
        p = os.path.join(folder, "agent_ttl_sweep.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="kvstore bench agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
