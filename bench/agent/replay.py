"""The replay of ``kvstore bench agent``: requests in time order through a real KVStore on a
virtual clock (lookup, load of the matched blocks, store of the rest); totals, per-window series
and the store's own metrics (see bench/agent/)."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from kvstore.bench.common import stores
from kvstore.bench.agent import workload as wl
from kvstore.config import GiB, from_dict
from kvstore.tiers.memory import alloc_aligned
from kvstore.store.metrics import MISS_REASONS
from kvstore.store import KVStore


def payload(keys: Sequence[bytes], nbytes: int) -> np.ndarray:
    """Deterministic block bytes: the key repeated (so any hit can be checked without a copy kept)."""
    k = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 16)
    return np.ascontiguousarray(np.tile(k, (1, nbytes // 16)))


def _open_store(store: Mapping, *, block_tokens: int, payload_bytes: int, kv_block_bytes: int | None, folder: str,
                clock: Callable[[], float]) -> tuple[KVStore, dict]:
    """A store of the ``store`` section (public schema) in ``folder``; when ``kv_block_bytes`` is
    given, each tier holds as many synthetic blocks as it holds blocks of the real model (the NVMe
    entry sized for the header layout the folder's file system gives). Returns (store, blocks per tier)."""
    cfg = from_dict(store)
    d = wl.merged(cfg.to_dict(), {"tiers": {"nvme": {"path": folder}}, "metrics": {"port": None}, "trace_path": None})
    blocks: dict = {"dram": None, "nvme": None}
    if kv_block_bytes:
        nv = cfg.tiers.nvme
        if nv.enabled and nv.codec != "none":
            raise ValueError(f"tiers.nvme.codec: bench agent stores synthetic payloads and sizes tiers in blocks of "
                             f"them; a codec ({nv.codec}) would change both: use none")
        xattr = nv.enabled and stores.nvme_xattr(folder, nv.header)
        for name, tcfg in (("dram", cfg.tiers.dram), ("nvme", nv)):
            blocks[name] = tcfg.capacity_bytes // kv_block_bytes
            d["tiers"][name]["capacity_gb"] = stores.capacity_gb(blocks[name], payload_bytes, name, xattr=xattr)
    fp = wl.ModelFingerprint(model=f"bench-agent-{os.getpid()}-{time.perf_counter_ns()}", block_size=block_tokens)
    # the whole DRAM pool, as configured, from the first request
    s = stores.open_store(d, block_bytes=payload_bytes, fingerprint=fp, block_tokens=block_tokens, clock=clock)
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
        s.flush()  # background moves still in flight (demotions of the last evictions) counted too
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
