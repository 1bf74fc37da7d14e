"""The hit-rate readout of a store's and an engine's metrics: what ``kvstore stats`` prints
(:mod:`kvstore.ops.stats` fetches the samples) and the connector logs at shutdown.

With the vLLM connector, the hit rate is **served / (prompt - engine-local)**: the tokens
kvstore loaded into the engine, over the prompt tokens the engine did not already hold. Tokens
kvstore held that the engine already had are shown apart, never as hits. Without an engine (a
benchmark, a replay), the store's own lookups are summarized: found / looked up.

Served tokens are split into *replay* (the exact prompt was seen before) and *genuine* reuse
(a new prompt sharing a stored prefix; kvstore.offload.replay): a hit rate built on replays
(a staging test resending the same prompts) says little about production traffic.

A node daemon (``kvstore serve``) exports the samples of each model's store and of each engine
attached to it, labelled ``model`` and ``engine`` (:mod:`kvstore.node.metrics`): the readout is
the host's (summed over those labels), then each engine's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvstore.store.metrics import KINDS, TIERS

HIT_RATE_MEANS = "served / (prompt - engine-local hits)"
HELD_NOT_SERVED = ("kvstore has these blocks, but vLLM's own prefix cache answered first: to see kvstore serve "
                   "them, send the prompt again after POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1), or after "
                   "a restart whose stop let kvstore write DRAM down to disk (vLLM's --shutdown-timeout 60: its "
                   "default 0 kills the engine first)")


def _key(name: str, labels: dict) -> tuple:
    return name, tuple(sorted(labels.items()))


SPLIT = ("engine", "model", "root")  # a node daemon's labels: summed over for the host
NODE_MARK = "kvstore_node_engines"  # a gauge only a node daemon exports


def parse(text: str) -> dict:
    vals = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            vals[_key(s.name, s.labels)] = s.value
    return summarize(vals)


def _host(vals: dict) -> dict:
    """``vals`` summed over the SPLIT labels."""
    out: dict = {}
    for (n, labels), v in vals.items():
        k = (n, tuple(kv for kv in labels if kv[0] not in SPLIT))
        out[k] = out.get(k, 0.0) + v
    return out


def _engines(vals: dict) -> dict[str, dict]:
    """engine -> its samples, the engine label taken off (a node daemon's per-engine samples)."""
    out: dict[str, dict] = {}
    for (n, labels), v in vals.items():
        d = dict(labels)
        if "engine" in d:
            e = d.pop("engine")
            out.setdefault(e, {})[_key(n, {k: x for k, x in d.items() if k not in SPLIT})] = v
    return out


def values(registry: CollectorRegistry) -> dict:
    """The registry's samples, keyed like :func:`parse`'s."""
    return {_key(s.name, s.labels): s.value for fam in registry.collect() for s in fam.samples}


def _get(vals: dict, name: str, **labels) -> float:
    return vals.get(_key(name, labels), 0.0)


def _by(vals: dict, name: str, label: str) -> dict[str, float]:
    return {dict(l)[label]: v for (n, l), v in vals.items() if n == name and label in dict(l)}


def _by_kind(vals: dict) -> dict[str, dict[str, float]]:
    """kind -> tier -> served tokens (kvstore_engine_served_tokens_by_kind_total)."""
    out: dict[str, dict[str, float]] = {k: {t: 0.0 for t in TIERS} for k in KINDS}
    for (n, l), v in vals.items():
        d = dict(l)
        if n == "kvstore_engine_served_tokens_by_kind_total" and d.get("kind") in out and d.get("tier") in TIERS:
            out[d["kind"]][d["tier"]] += v
    return out


SHOWN_TAGS = 10  # request tags shown by name (the most prompt tokens); the rest summed as "other"


def tag_summary(vals: dict, top: int = SHOWN_TAGS) -> dict[str, dict]:
    """tag -> prompt, engine-local and kvstore-pinned tokens and hit rate (pinned / (prompt - local)),
    the ``top`` tags with most prompt tokens by name, the rest (and the metric's own "other") summed."""
    prompt = _by(vals, "kvstore_engine_tag_prompt_tokens_total", "tag")
    local = _by(vals, "kvstore_engine_tag_local_hit_tokens_total", "tag")
    hit = _by(vals, "kvstore_engine_tag_hit_tokens_total", "tag")
    named = [t for t in sorted(prompt, key=lambda t: (-prompt[t], t)) if t != "other"][:top]
    out: dict[str, dict] = {}
    for t in prompt:
        d = out.setdefault(t if t in named else "other", {"prompt_tokens": 0, "local_tokens": 0, "hit_tokens": 0})
        d["prompt_tokens"] += int(prompt[t])
        d["local_tokens"] += int(local.get(t, 0))
        d["hit_tokens"] += int(hit.get(t, 0))
    for d in out.values():
        need = d["prompt_tokens"] - d["local_tokens"]
        d["hit_rate"] = d["hit_tokens"] / need if need > 0 else 0.0
    return dict(sorted(out.items(), key=lambda kv: (kv[0] == "other", -kv[1]["prompt_tokens"])))


def engine_summary(vals: dict) -> dict | None:
    """Token accounting of the vLLM connector, or None if no engine metrics are present."""
    if not any(n == "kvstore_engine_prompt_tokens_total" for n, _ in vals):
        return None
    prompt = _get(vals, "kvstore_engine_prompt_tokens_total")
    local = _get(vals, "kvstore_engine_local_hit_tokens_total")
    served = {t: 0.0 for t in TIERS} | _by(vals, "kvstore_engine_served_tokens_total", "tier")
    held = {t: 0.0 for t in TIERS} | _by(vals, "kvstore_engine_held_tokens_total", "tier")
    unsupplied = _by(vals, "kvstore_engine_unsupplied_tokens_total", "reason")
    needed = prompt - local
    total = sum(served.values())
    kinds = _by_kind(vals)
    kind_total = {k: sum(v.values()) for k, v in kinds.items()}
    return {
        "requests": int(_get(vals, "kvstore_engine_requests_total")),
        "prompt_tokens": int(prompt),
        "engine_local_hit_tokens": int(local),
        "needed_tokens": int(needed),
        "served_tokens": {t: int(v) for t, v in served.items()},
        "held_tokens": {t: int(v) for t, v in held.items()},
        "unsupplied_tokens": {r: int(v) for r, v in sorted(unsupplied.items(), key=lambda kv: -kv[1]) if v},
        "stored_blocks": int(_get(vals, "kvstore_engine_stored_blocks_total")),
        "hit_rate": total / needed if needed > 0 else 0.0,
        "hit_rate_by_tier": {t: (v / needed if needed > 0 else 0.0) for t, v in served.items()},
        "hit_rate_means": HIT_RATE_MEANS,
        # served tokens by kind and tier; hit rates over the same denominator (they sum to hit_rate)
        "served_tokens_by_kind": {k: {t: int(n) for t, n in v.items()} for k, v in kinds.items()},
        "hit_rate_by_kind": {k: (v / needed if needed > 0 else 0.0) for k, v in kind_total.items()},
        "replay_share_of_served": kind_total["replay"] / total if total > 0 else 0.0,
        "tags": tag_summary(vals),
    }


def summarize(vals: dict) -> dict:
    """The readout of one store's samples, or of a node daemon's: its host's, with ``engines``."""
    if not any(n == NODE_MARK for n, _ in vals):
        return _summarize(vals)
    out = _summarize(_host(vals))
    out["engines"] = {e: engine_summary(v) for e, v in sorted(_engines(vals).items())}
    return out


def _summarize(vals: dict) -> dict:
    lookup = _get(vals, "kvstore_lookup_tokens_total")
    tiers = sorted(_by(vals, "kvstore_tier_blocks", "tier"))
    hits = {t: _get(vals, "kvstore_lookup_hit_tokens_total", tier=t) for t in tiers}
    total_hit = sum(hits.values())
    return {
        "engine": engine_summary(vals),
        "lookups": {
            "lookup_tokens": lookup,
            "hit_tokens": total_hit,
            "hit_rate": total_hit / lookup if lookup else 0.0,
            "hit_rate_by_tier": {t: (h / lookup if lookup else 0.0) for t, h in hits.items()},
            "miss_tokens_by_reason": _by(vals, "kvstore_lookup_miss_tokens_total", "reason"),
        },
        "tiers": {t: {"blocks": _get(vals, "kvstore_tier_blocks", tier=t),
                      "bytes": _get(vals, "kvstore_tier_used_bytes", tier=t),
                      "capacity_bytes": _get(vals, "kvstore_tier_capacity_bytes", tier=t),
                      "evictions": _get(vals, "kvstore_tier_evicted_blocks_total", tier=t),
                      "expirations": _get(vals, "kvstore_tier_expired_blocks_total", tier=t)} for t in tiers},
        "corrupt_files": sum(v for (n, _), v in vals.items() if n == "kvstore_corrupt_files_total"),
    }


def render_engine(e: dict) -> list[str]:
    lines = [f"kvstore hit rate: {e['hit_rate']:.1%} = {HIT_RATE_MEANS} = {sum(e['served_tokens'].values())} / "
             f"({e['prompt_tokens']} - {e['engine_local_hit_tokens']}) tokens, {e['requests']} requests"]
    for t, r in e["hit_rate_by_tier"].items():
        lines.append(f"  served from {t:6s} {r:6.1%}  ({e['served_tokens'][t]} tokens)")
    kinds = e.get("served_tokens_by_kind")
    if kinds and any(sum(v.values()) for v in kinds.values()):
        for k in ("replay", "genuine"):
            by_tier = ", ".join(f"{t} {n}" for t, n in kinds[k].items() if n) or "none"
            lines.append(f"  {k:17s} {e['hit_rate_by_kind'][k]:6.1%}  ({sum(kinds[k].values())} tokens: {by_tier})")
        lines.append(f"  (replay: the exact prompt was seen before, {e['replay_share_of_served']:.1%} of served; "
                     "genuine: a new prompt sharing a stored prefix)")
    held = sum(e["held_tokens"].values())
    if held:
        lines.append("held by kvstore but already in the engine's prefix cache (not hits): "
                     + ", ".join(f"{t} {n}" for t, n in e["held_tokens"].items() if n))
        if not sum(e["served_tokens"].values()):
            lines.append(f"  ({HELD_NOT_SERVED})")
    if e["unsupplied_tokens"]:
        lines.append("computed by the engine (tokens), by why kvstore could not supply them:")
        for k, v in e["unsupplied_tokens"].items():
            lines.append(f"  {k:13s} {v}")
    if e.get("tags"):
        lines.append("by request tag (kvstore.tag): hit rate = pinned by kvstore / (prompt - engine-local)")
        for t, d in e["tags"].items():
            lines.append(f"  {t[:24]:24s} {d['hit_rate']:6.1%}  ({d['hit_tokens']} / ({d['prompt_tokens']} - "
                         f"{d['local_tokens']}) tokens)")
    lines.append(f"blocks stored from the engine: {e['stored_blocks']}")
    return lines


def render(s: dict) -> str:
    lines = render_engine(s["engine"]) if s["engine"] else []
    lk = s["lookups"]
    if lk["lookup_tokens"] or not s["engine"]:
        lines.append(f"store lookups (direct callers): {lk['hit_rate']:.1%} of {int(lk['lookup_tokens'])} "
                     "tokens found")
        for t, r in lk["hit_rate_by_tier"].items():
            lines.append(f"  {t:5s} {r:.1%}")
        if lk["miss_tokens_by_reason"]:
            lines.append("  misses (tokens) by reason:")
            for k, v in sorted(lk["miss_tokens_by_reason"].items(), key=lambda kv: -kv[1]):
                lines.append(f"    {k:13s} {int(v)}")
    for t, d in s["tiers"].items():
        cap = d["capacity_bytes"] or 1
        lines.append(f"{t}: {int(d['blocks'])} blocks, {d['bytes'] / 2**20:.1f} MiB "
                     f"({d['bytes'] / cap:.0%} of capacity), {int(d['evictions'])} evicted, "
                     f"{int(d['expirations'])} expired")
    lines.append(f"corrupt files dropped: {int(s['corrupt_files'])}")
    if s.get("engines") is not None:
        lines.append(f"engines ({len(s['engines'])}; the lines above are the host's):")
        for name, e in s["engines"].items():
            if e is None:
                continue
            lines.append(f"  {name[:40]:40s} {e['hit_rate']:6.1%}  ({sum(e['served_tokens'].values())} / "
                         f"({e['prompt_tokens']} - {e['engine_local_hit_tokens']}) tokens, {e['requests']} requests, "
                         f"{e['stored_blocks']} blocks stored)")
    return "\n".join(lines)
