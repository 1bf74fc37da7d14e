"""``kvstore bench agent``: a synthetic agent workload replayed through a real KVStore (no model).

Sessions share a system prompt and tool schemas; turns are append-only; think times are heavy
tailed (seconds for the agent loop, minutes to hours for humans); see ``bench/agent/workload.py``.
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
import os
import tempfile
from typing import Any

import yaml

from kvstore.bench.common import harness
from kvstore.bench.agent import workload as wl
from kvstore.bench.agent.replay import VirtualClock, default_dir, payload, replay
from kvstore.bench.agent.report import plot, render
from kvstore.config import SHIPPED_DIR, from_dict
from kvstore.trace import RECORDED_KEY, recorded_fields

__all__ = ["BENCH_DEFAULTS", "VirtualClock", "add_args", "default_dir", "main", "payload", "plot", "render", "replay",
           "resolve", "run"]

DEFAULT_CONFIG = os.path.join(SHIPPED_DIR, "bench_agent.yaml")  # shipped in the package (configs/ links to it)

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
    p.add_argument("--config", default=None, help="bench YAML (default: the shipped bench_agent.yaml, "
                   "configs/bench_agent.yaml in the repository)")
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
    p.add_argument("--dir", default=None, type=harness.folder, help="parent folder for the NVMe tier's files (default: /dev/shm when "
                   "there is one: this bench measures policy, not disk speed; give a disk folder to include it)")
    harness.output_args(p)


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
    data: dict = harness.read_yaml(path) if path else {}
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


# -- the command ---------------------------------------------------------------------------------

def _variant_requests(cfg: dict, variant: str) -> list[wl.Request]:
    return wl.generate(wl.merged(cfg["workload"], cfg["variants"][variant] or {}))


def _stamp(path: str, recorded: dict) -> None:
    """Add ``recorded`` (the store config and KV block the bench replays) to the trace's first line:
    ``kvstore tune`` takes its budget and block size from it; every reader ignores it otherwise."""
    import json

    with open(path) as f:
        lines = f.readlines()
    if lines:
        first = json.loads(lines[0])
        first[RECORDED_KEY] = recorded
        lines[0] = json.dumps(first, separators=(",", ":")) + "\n"
        with open(path, "w") as f:
            f.writelines(lines)


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
        recorded = recorded_fields(from_dict(cfg["store"]).to_dict()["tiers"], kv_block_bytes, bt,
                                   "kvstore bench agent", kv_bytes_per_token=kv_per_token)
        for i, (v, reqs) in enumerate(inputs.items()):
            p = _trace_path(a.trace_out, i, v)
            wl.write_trace(reqs, p, bt)
            _stamp(p, recorded)
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
    with harness.Progress(total, "bench agent") as bar:
        for v, reqs in inputs.items():
            bar.label(v)
            with tempfile.TemporaryDirectory(prefix="kvstore-bench-agent-", dir=parent) as d:
                results[v] = replay(reqs, cfg["store"], block_tokens=bt, payload_bytes=payload_bytes,
                                    kv_block_bytes=kv_block_bytes, windows=windows, verify=verify, folder=d,
                                    advance=bar.advance)
        for series, ttl in sweep_runs:
            bar.label(f"TTL sweep {series} {ttl}")
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
                           advance=bar.advance)
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
    return harness.report(a, data, render, plot)


def main(argv=None) -> dict:
    return harness.main(__name__, argv)
