"""What the tuner searched, as the slices where each axis was actually varied (the report prints
them, the plots draw them): every capacity and TTL it replayed appears in one of them.

A staged search varies the DRAM axes with NVMe at its largest setting, then the NVMe axes at the
DRAM pick, then NVMe admission at the pick: the DRAM slice is therefore not at the
recommendation's NVMe setting (a table "through the recommendation" showed one DRAM row, and the
DRAM plot one dot). A full search varies every axis everywhere: its slices go through the
recommendation. Either way a slice is the group of settings, sharing the other tier's
coordinates, with the most settings of this tier (ties: the recommendation's own group).
"""

from __future__ import annotations

from typing import Sequence

from kvstore.tune.grid import ttl_key
from kvstore.tune.recommend import setting
from kvstore.tune.simulate import LOWER, TOP

AXES = {TOP: (0, 1), LOWER: (2, 3)}  # (capacity, ttl) positions in a setting


def slice_of(points: Sequence[dict], rec: dict, tier: str) -> tuple[tuple, list[dict]]:
    """(the fixed coordinates, the points) of the slice where ``tier``'s capacity x TTL was searched.
    For NVMe, only the points at the recommendation's admit_after (admission has its own slices)."""
    ci, ti = AXES[tier]
    fixed = [j for j in range(5) if j not in (ci, ti)]
    s = setting(rec)
    groups: dict[tuple, list[dict]] = {}
    for r in points:
        q = setting(r)
        if tier == LOWER and q[4] != s[4]:
            continue
        groups.setdefault(tuple(q[j] for j in fixed), []).append(r)
    if not groups:
        return tuple(s[j] for j in fixed), []
    mine = tuple(s[j] for j in fixed)
    key = max(groups, key=lambda k: (len({(setting(r)[ci], setting(r)[ti]) for r in groups[k]}), k == mine))
    return key, groups[key]


def admission(points: Sequence[dict], rec: dict) -> dict[int, list[dict]]:
    """admit_after -> the NVMe capacity x TTL points at the recommendation's DRAM setting."""
    s = setting(rec)
    out: dict[int, list[dict]] = {}
    for r in points:
        q = setting(r)
        if q[0] == s[0] and q[1] == s[1]:
            out.setdefault(q[4], []).append(r)
    return dict(sorted(out.items())) if len(out) > 1 else {}


def pivot(rows: Sequence[dict], tier: str, cell, rec: dict, fmt_ttl) -> list[str]:
    """A Markdown table: capacity down, TTL across, ``cell(point)`` in each; the recommendation bold."""
    ci, ti = AXES[tier]
    caps = sorted({setting(r)[ci] for r in rows})
    ttls = sorted({setting(r)[ti] for r in rows}, key=ttl_key)
    at = {(setting(r)[ci], setting(r)[ti]): r for r in rows}
    s = setting(rec)
    out = [f"| {tier.upper()} GB \\ TTL | " + " | ".join(fmt_ttl(t) for t in ttls) + " |",
           "|---|" + "---|" * len(ttls)]
    for c in caps:
        cells = []
        for t in ttls:
            r = at.get((c, t))
            v = "" if r is None else cell(r)
            cells.append(f"**{v}**" if r is not None and setting(r) == s else v)
        out.append(f"| {c:g} | " + " | ".join(cells) + " |")
    return out


def describe(points: Sequence[dict], rec: dict, fmt_ttl, fmt_written) -> list[str]:
    """The report's "Searched" section: one table per slice, every coordinate replayed."""
    out = ["## Searched: every capacity and TTL replayed", ""]
    shown: set = set()
    for tier in (TOP, LOWER):
        key, rows = slice_of(points, rec, tier)
        if not rows:
            continue
        ci, ti = AXES[tier]
        n_c, n_t = len({setting(r)[ci] for r in rows}), len({setting(r)[ti] for r in rows})
        if tier == TOP:
            at = f"NVMe {key[0]:g} GB, TTL {fmt_ttl(key[1])}, admit_after {key[2]}"
            what = "hit % of all prompt tokens (DRAM's share)"
        else:
            at = f"DRAM {key[0]:g} GB, TTL {fmt_ttl(key[1])}, admit_after {key[2]}"
            what = "hit % (NVMe's share)"
        out += [f"{tier.upper()}: {n_c} capacities x {n_t} TTLs = {len(rows)} settings, at {at}; each cell: {what}.",
                ""]
        out += pivot(rows, tier, lambda r, t=tier: f"{r['hit_rate'] * 100:.1f} ({r['hit_rate_by_tier'][t] * 100:.1f})",
                     rec, fmt_ttl)
        out.append("")
        shown.update(setting(r) for r in rows)
    adm = admission(points, rec)
    for a, rows in adm.items():
        if a == setting(rec)[4]:
            continue  # the NVMe table above
        what = "every block written" if a <= 1 else f"a block written once {a} requests used it"
        out += [f"NVMe with admit_after {a} ({what}), at the DRAM pick; each cell: hit % (NVMe bytes written per "
                "hour of trace).", ""]
        out += pivot(rows, LOWER, lambda r: f"{r['hit_rate'] * 100:.1f} ({fmt_written(r)})", rec, fmt_ttl)
        out.append("")
        shown.update(setting(r) for r in rows)
    rest = len({setting(r) for r in points} - shown)
    if rest > 0:
        out += [f"The other {rest} settings combine these coordinates (a full search replays every combination): "
                "`--all` lists each one, `--json` holds them all.", ""]
    return out
