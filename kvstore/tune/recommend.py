"""Pick the setting to recommend, and say what limits it (TTL or capacity).

Objective: the prefill tokens saved (token-weighted hits, both tiers). With a cost model,
the net value ``saved x price_per_token - sum_tiers(price_per_GB_hour x mean GB held x hours)``
(mean GB held: the time average of the bytes the tier holds over the trace). Settings within
``tol`` of the best (default 0.1 % of the prompt tokens, in the objective's unit) count as
equally good; among those, the one serving the most tokens from DRAM (faster loads, within
``tol``), then the smallest footprint (mean DRAM bytes, mean NVMe bytes, capacities, TTLs, NVMe
bytes written). So when every think time is under a minute, a TTL just over a minute wins over
longer ones, and an NVMe admission filter (``admit_after``) that loses no hits wins over none:
it holds fewer bytes on NVMe and writes fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.tune.grid import ttl_key
from kvstore.tune.simulate import LOWER, TOP

GB = float(1 << 30)


@dataclass(frozen=True)
class CostModel:
    gb_hour_dram: float = 0.0
    gb_hour_nvme: float = 0.0
    prefill_token: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.gb_hour_dram or self.gb_hour_nvme or self.prefill_token)

    def storage_cost(self, r: dict) -> float:
        hours = r["duration_s"] / 3600.0
        bh = r["bytes_held"]
        return (self.gb_hour_dram * bh[TOP]["mean"] / GB + self.gb_hour_nvme * bh[LOWER]["mean"] / GB) * hours

    def value(self, r: dict) -> float:
        return r["saved_prefill_tokens"] * self.prefill_token - self.storage_cost(r)


def setting(r: dict) -> tuple:
    t = r["tiers"]
    return (t[TOP]["capacity_gb"], t[TOP]["ttl_s"], t[LOWER]["capacity_gb"], t[LOWER]["ttl_s"],
            t[LOWER].get("admit_after", 0))


def objective(r: dict, cost: CostModel | None) -> float:
    return cost.value(r) if cost is not None and cost.active else float(r["saved_prefill_tokens"])


def footprint(r: dict) -> tuple:
    bh, t = r["bytes_held"], r["tiers"]
    return (bh[TOP]["mean"], bh[LOWER]["mean"], t[TOP]["capacity_gb"], t[LOWER]["capacity_gb"],
            ttl_key(t[TOP]["ttl_s"]), ttl_key(t[LOWER]["ttl_s"]), r.get("nvme_written_bytes", 0))


def pick(points: list[dict], cost: CostModel | None = None, tol_pp: float = 0.1) -> dict:
    """The recommended point among ``points`` (see the module doc)."""
    if not points:
        raise ValueError("no grid points")
    tol_tokens = tol_pp / 100.0 * max(1, points[0]["prompt_tokens"])
    active = cost is not None and cost.active
    tol = tol_tokens * (cost.prefill_token if active and cost.prefill_token else 1.0)
    best = max(objective(r, cost) for r in points)
    cands = [r for r in points if objective(r, cost) >= best - tol]
    most_dram = max(r["hit_tokens_by_tier"][TOP] for r in cands)
    cands = [r for r in cands if r["hit_tokens_by_tier"][TOP] >= most_dram - tol_tokens]
    return min(cands, key=footprint)


def ranked(points: list[dict], cost: CostModel | None = None, tol_pp: float = 0.1, k: int | None = None) -> list[dict]:
    """The ``k`` best points in :func:`pick`'s order of preference."""
    rest, out = list(points), []
    while rest and (k is None or len(out) < k):
        r = pick(rest, cost, tol_pp)
        out.append(r)
        rest = [x for x in rest if x is not r]
    return out


def _block_tokens(r: dict) -> float:
    """Tokens per block of the trace (lookup tokens / blocks looked up)."""
    return r.get("block_tokens") or 1


def _tier_metric(r: dict, tier: str) -> int:
    """What a tier's capacity buys: DRAM hits (NVMe below catches the rest); for the last tier, all hits."""
    return r["hit_tokens_by_tier"][TOP] if tier == TOP else r["saved_prefill_tokens"]


def analyse(points: list[dict], rec: dict, tol_pp: float = 0.1) -> dict:
    """Per tier: is the capacity binding at the recommendation, and where the hit rate stops rising with TTL."""
    tol = tol_pp / 100.0 * max(1, rec["prompt_tokens"])
    pt = max(1, rec["prompt_tokens"])
    s0, rec0 = setting(rec), rec
    by = {setting(r): r for r in points}
    a0 = min(p[4] for p in by)  # the grid's admit_after: the DRAM slices were searched there
    out = {}
    for tier, (ci, ti) in ((TOP, (0, 1)), (LOWER, (2, 3))):
        s, rec = s0, rec0
        if tier == TOP and s[4] != a0 and s[:4] + (a0,) in by:  # NVMe admission: read DRAM at a0
            s = s[:4] + (a0,)
            rec = by[s]
        info: dict = {"capacity_binding": False, "binding_at_every_ttl": False, "ttl_saturates_at": None,
                      "detail": ""}
        if s[ci] <= 0:
            info["detail"] = f"{tier} disabled (capacity 0)"
            out[tier] = info
            continue
        caps = sorted({p[ci] for p in by if all(p[j] == s[j] for j in range(len(s)) if j != ci)})
        lower = [c for c in caps if c < s[ci] and c > 0]
        at_budget = s[ci] == max(caps)
        evicts = rec["evicted_for_capacity"][tier] > 0
        rising = False
        if lower:
            q = list(s)
            q[ci] = lower[-1]
            rising = _tier_metric(rec, tier) - _tier_metric(by[tuple(q)], tier) > tol
        elif tier == LOWER or s[2] <= 0:  # the last tier: misses of blocks evicted for capacity
            rising = rec["misses_by_reason"]["evicted"] > tol
        binding = at_budget and evicts and rising
        # the TTL slice at this capacity
        ttl_pts = sorted((r for p, r in by.items() if all(p[j] == s[j] for j in range(len(s)) if j != ti)),
                         key=lambda r: ttl_key(setting(r)[ti]))
        # every TTL (even the shortest) evicts a meaningful amount for capacity: no TTL fits the budget
        every = bool(ttl_pts) and all(r["evicted_for_capacity"][tier] * _block_tokens(r) > tol for r in ttl_pts)
        if ttl_pts:
            top = max(_tier_metric(r, tier) for r in ttl_pts)
            sat = next(r for r in ttl_pts if _tier_metric(r, tier) >= top - tol)
            info["ttl_saturates_at"] = setting(sat)[ti]
            info["ttl_rises_to_the_longest"] = setting(sat)[ti] == setting(ttl_pts[-1])[ti] and len(ttl_pts) > 1
        what = "DRAM hits" if tier == TOP else "hits"
        if binding:
            info["detail"] = (f"capacity is binding: at the {tier} budget ({s[ci]:g} GB) "
                              f"{rec['evicted_for_capacity'][tier]} blocks were evicted for capacity and {what} "
                              f"still rise with capacity" + (
                                  f" ({_tier_metric(by[tuple(q)], tier) / pt:.1%} at {lower[-1]:g} GB -> "
                                  f"{_tier_metric(rec, tier) / pt:.1%})" if lower else
                                  f" ({rec['misses_by_reason']['evicted'] / pt:.1%} of prompt tokens missed "
                                  f"because their blocks were evicted)"))
            if every:
                info["detail"] += "; it evicts for capacity at every TTL: the budget is too small for any TTL"
        elif evicts:
            info["detail"] = f"evicts for capacity ({rec['evicted_for_capacity'][tier]} blocks) without losing {what}"
        else:
            info["detail"] = "capacity not binding (never evicted for capacity)"
        info["capacity_binding"] = binding
        info["binding_at_every_ttl"] = binding and every
        out[tier] = info
    return out
