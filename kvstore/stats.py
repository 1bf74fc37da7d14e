"""``kvstore stats``: read a store's Prometheus endpoint and summarize what matters.

Token-weighted hit rate overall and per tier, misses by reason, bytes and blocks per tier.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> dict:
    vals: dict[tuple, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            vals[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return summarize(vals)


def _get(vals: dict, name: str, **labels) -> float:
    return vals.get((name, tuple(sorted(labels.items()))), 0.0)


def summarize(vals: dict) -> dict:
    lookup = _get(vals, "kvstore_lookup_tokens_total")
    tiers = sorted({dict(l).get("tier") for (n, l) in vals if n == "kvstore_blocks" and dict(l).get("tier")})
    hits = {t: _get(vals, "kvstore_hit_tokens_total", tier=t) for t in tiers}
    reasons = {dict(l)["reason"]: v for (n, l), v in vals.items() if n == "kvstore_miss_tokens_total"}
    total_hit = sum(hits.values())
    return {
        "lookup_tokens": lookup,
        "hit_tokens": total_hit,
        "hit_rate": total_hit / lookup if lookup else 0.0,
        "hit_rate_by_tier": {t: (h / lookup if lookup else 0.0) for t, h in hits.items()},
        "miss_tokens_by_reason": reasons,
        "tiers": {t: {"blocks": _get(vals, "kvstore_blocks", tier=t), "bytes": _get(vals, "kvstore_bytes", tier=t),
                      "capacity_bytes": _get(vals, "kvstore_capacity_bytes", tier=t),
                      "evictions": _get(vals, "kvstore_evictions_total", tier=t),
                      "expirations": _get(vals, "kvstore_expirations_total", tier=t)} for t in tiers},
        "corrupt_files": sum(v for (n, _), v in vals.items() if n == "kvstore_corrupt_files_total"),
    }


def fetch(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - a user-given local URL
        return parse(r.read().decode())


def render(s: dict) -> str:
    lines = [f"hit rate (tokens): {s['hit_rate']:.1%} of {int(s['lookup_tokens'])} looked up"]
    for t, r in s["hit_rate_by_tier"].items():
        lines.append(f"  {t:5s} {r:.1%}")
    if s["miss_tokens_by_reason"]:
        lines.append("misses (tokens) by reason:")
        for k, v in sorted(s["miss_tokens_by_reason"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {k:13s} {int(v)}")
    for t, d in s["tiers"].items():
        cap = d["capacity_bytes"] or 1
        lines.append(f"{t}: {int(d['blocks'])} blocks, {d['bytes'] / 2**20:.1f} MiB "
                     f"({d['bytes'] / cap:.0%} of capacity), {int(d['evictions'])} evicted, "
                     f"{int(d['expirations'])} expired")
    lines.append(f"corrupt files dropped: {int(s['corrupt_files'])}")
    return "\n".join(lines)
