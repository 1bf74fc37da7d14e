"""The tuner's outputs: Markdown summary, YAML config, JSON, PNG plots."""

from __future__ import annotations

import json
import os
from typing import Sequence

from kvstore.config import from_dict, merge
from kvstore.tune.grid import ttl_key
from kvstore.tune.recommend import setting
from kvstore.tune.simulate import LOWER, TOP

REASONS = ("never_stored", "evicted", "expired", "diverged", "below_min", "not_admitted")


def fmt_ttl(ttl: float | None) -> str:
    if ttl is None:
        return "none"
    t = float(ttl)
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if t >= s and t % s == 0:
            return f"{int(t // s)}{unit}"
    return f"{t:g}s"


def parse_ttl(s: str) -> float | None:
    s = s.strip().lower()
    if s in ("none", "null", "inf", "never", "-"):
        return None
    mult = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if s and s[-1] in mult:
        v = float(s[:-1]) * mult[s[-1]]
    else:
        v = float(s)
    if not v > 0:
        raise ValueError(f"a TTL must be > 0 seconds or none, got {s!r}")
    return v


def fmt_bytes(n: float) -> str:
    for unit, s in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            v = n / s
            return f"{v:.3g} {unit}" if v < 999.5 else f"{v:.0f} {unit}"  # (.3g of 999.9 is 1e+03)
    return f"{int(n)} B"


def _held(r: dict, tier: str) -> str:
    h = r["bytes_held"][tier]
    if not h["capacity"]:
        return "-"
    return f"{fmt_bytes(h['p50'])} / {fmt_bytes(h['p99'])} / {fmt_bytes(h['max'])}"


def _written(r: dict) -> str:
    """NVMe bytes written per hour of trace (block bytes: kvstore_tier_written_bytes_total{tier=LOWER})."""
    if not r["bytes_held"][LOWER]["capacity"]:
        return "-"
    h = r.get("nvme_written_bytes_per_hour")
    return "-" if h is None else fmt_bytes(h)


def order(r: dict) -> tuple:
    """Sort key of a grid point: its setting, a TTL of none last."""
    s = setting(r)
    return (s[0], ttl_key(s[1]), s[2], ttl_key(s[3]), s[4])


def slices(points: Sequence[dict], rec: dict) -> list[dict]:
    """The points that differ from the recommendation in at most one coordinate (or from its twin
    at the grid's admit_after, where the DRAM slices were searched)."""
    s = setting(rec)
    refs = {s, s[:4] + (min(setting(r)[4] for r in points),)}
    out = [r for r in points if any(sum(a != b for a, b in zip(setting(r), q)) <= 1 for q in refs)]
    return sorted(out, key=order)


def table(rows: Sequence[dict], rec: dict | None = None) -> str:
    head = ("| | DRAM GB | DRAM TTL | NVMe GB | NVMe TTL | NVMe admit after | hit % | NVMe written / h "
            "| DRAM % | NVMe % | replay % | genuine % "
            "| prefill saved (tokens) | DRAM held p50 / p99 / max | NVMe held p50 / p99 / max "
            "| misses % (never / evicted / expired / diverged / below min / not admitted) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["tiers"]
        pt = max(1, r["prompt_tokens"])
        mark = "**→**" if rec is not None and setting(r) == setting(rec) else ""
        miss = " / ".join(f"{r['misses_by_reason'].get(k, 0) / pt * 100:.1f}" for k in REASONS)
        lines.append(f"| {mark} | {t[TOP]['capacity_gb']:g} | {fmt_ttl(t[TOP]['ttl_s'])} | "
                     f"{t[LOWER]['capacity_gb']:g} | {fmt_ttl(t[LOWER]['ttl_s'])} | "
                     f"{t[LOWER].get('admit_after', 0)} | {r['hit_rate'] * 100:.1f} | {_written(r)} | "
                     f"{r['hit_rate_by_tier'][TOP] * 100:.1f} | {r['hit_rate_by_tier'][LOWER] * 100:.1f} | "
                     f"{r['replay_hit_rate'] * 100:.1f} | {r['genuine_hit_rate'] * 100:.1f} | "
                     f"{r['saved_prefill_tokens']:,} | {_held(r, TOP)} | {_held(r, LOWER)} | {miss} |")
    return "\n".join(lines)


def markdown(res: dict, all_rows: bool = False) -> str:
    tr, rec, an = res["trace"], res["recommended"], res["analysis"]
    t = rec["tiers"]
    out = [f"# kvstore tune: {res.get('trace_path', 'trace')}", ""]
    bt = tr["block_tokens"]
    out.append(f"Trace: {tr['requests']:,} requests, {tr['sessions']:,} sessions, {tr['duration_s'] / 3600:.2f} h, "
               f"{tr['prompt_tokens']:,} prompt tokens, {tr['blocks_per_request']:.1f} blocks/request "
               f"({bt} tokens, {fmt_bytes(res['block_bytes'])} per block), "
               f"{tr['replay_requests'] / max(1, tr['requests']):.1%} replayed prompts.")
    tm = res["timing"]
    samp = ""
    if res.get("sample_rate", 1.0) < 1:
        st = res["sampled_trace"]
        samp = (f" screened on a {res['sample_rate']:.2%} session sample ({st['sessions']:,} sessions, "
                f"{st['requests']:,} requests; capacities scaled alike), the best {tm['confirmed']} replayed on "
                + ("the whole trace;" if (res.get("confirm_rate") or 1.0) >= 1
                   else f"a {res['confirm_rate']:.2%} session sample (the whole trace is too long to replay);"))
    out.append(f"Search: {res['search']}, {len(res['grid'])} settings ({tm['simulated']} replayed, "
               f"{tm['reused']} identical to a smaller one);{samp} {tm['seconds']:.1f} s on {tm['jobs']} "
               f"process(es), {tm['requests_per_s']:,.0f} requests/s per replay "
               f"({tr['blocks_per_request']:.0f} blocks a request).")
    b = res["budget"]
    src = res.get("sources") or {}
    if src.get("block_bytes"):
        out.append(f"Block: {fmt_bytes(res['block_bytes'])} ({src['block_bytes']}).")
    out.append(f"Budget: DRAM {b['dram_gb']:g} GB, NVMe {b['nvme_gb']:g} GB"
               + (f" ({src['budget']})" if src.get("budget") else "") + "." + (
        f" Cost model: DRAM {res['cost_model']['gb_hour_price_dram']:g}/GB-h, NVMe "
        f"{res['cost_model']['gb_hour_price_nvme']:g}/GB-h, prefill {res['cost_model']['prefill_token_price']:g}/token."
        if res.get("cost_model") else ""))
    for name, sec in (res.get("modelled_as_configured") or {}).items():
        out.append(f"Also modelled, as the base config has it (not searched): `tiers.{name}` capacity_gb "
                   f"{sec['capacity_gb']:g}, ttl_s {fmt_ttl(sec.get('ttl_s'))}.")
    out += ["", "## Recommended", ""]
    out.append(f"`tiers.dram`: capacity_gb {t[TOP]['capacity_gb']:g}, ttl_s {fmt_ttl(t[TOP]['ttl_s'])}; "
               f"`tiers.nvme`: capacity_gb {t[LOWER]['capacity_gb']:g}, ttl_s {fmt_ttl(t[LOWER]['ttl_s'])}, "
               f"admit_after {t[LOWER].get('admit_after', 0)}"
               + (f" → `{res['out']}`" if res.get("out") else ""))
    more = "".join(f", {name} {rec['hit_rate_by_tier'][name]:.1%}" for name in (res.get("modelled_as_configured") or {}))
    out.append(f"Hit rate {rec['hit_rate']:.1%} (DRAM {rec['hit_rate_by_tier'][TOP]:.1%}, NVMe "
               f"{rec['hit_rate_by_tier'][LOWER]:.1%}{more}; replay {rec['replay_hit_rate']:.1%}, genuine "
               f"{rec['genuine_hit_rate']:.1%}), {rec['saved_prefill_tokens']:,} prefill tokens saved"
               + (f", net value {rec['value']:,.4g}" if "value" in rec else "")
               + (f"; NVMe written {_written(rec)} per hour" if _written(rec) != "-" else "") + ".")
    for tier in (TOP, LOWER):
        a = an[tier]
        line = f"- {tier.upper()}: {a['detail']}"
        if a.get("ttl_saturates_at", None) is not None or a.get("ttl_rises_to_the_longest"):
            if a.get("ttl_rises_to_the_longest"):
                line += f"; its hit rate keeps rising with TTL up to {fmt_ttl(a['ttl_saturates_at'])}"
            else:
                line += f"; its hit rate stops rising at TTL {fmt_ttl(a['ttl_saturates_at'])}"
        out.append(line)
    from kvstore.tune.searched import describe

    out += [""] + describe(res["grid"], rec, fmt_ttl, _written)
    out += ["## Settings" + ("" if all_rows else " (through the recommendation, one coordinate varied)"), ""]
    rows = sorted(res["grid"], key=order) if all_rows else slices(res["grid"], rec)
    out.append(table(rows, rec if not res.get("confirmed") else
                     next((r for r in res["grid"] if setting(r) == setting(rec)), None)))
    if res.get("confirmed"):
        whole = (res.get("confirm_rate") or 1.0) >= 1
        where = "the whole trace" if whole else f"a {res['confirm_rate']:.2%} session sample"
        out += ["", f"Replayed on {where} ({len(res['confirmed'])} best of the screening):", "",
                table(res["confirmed"], rec)]
    if res.get("plots"):
        out += ["", "Plots: " + ", ".join(res["plots"])]
    return "\n".join(out) + "\n"


def write_yaml(path: str, rec: dict, base: dict | None, header: str) -> dict:
    """The recommended config (``base`` with the tuned keys replaced), validated, as YAML."""
    t = rec["tiers"]
    over = {"tiers": {tier: {"capacity_gb": t[tier]["capacity_gb"], "ttl_s": t[tier]["ttl_s"],
                             "ttl_shared_s": t[tier]["ttl_shared_s"], "policy": t[tier]["policy"]}
                      for tier in (TOP, LOWER)}}
    over["tiers"][LOWER]["admit_after"] = t[LOWER].get("admit_after", 0)
    cfg = from_dict(merge(base or {}, over))
    d = cfg.to_dict()
    d["tiers"][TOP]["capacity_gb"] = _num(d["tiers"][TOP]["capacity_gb"])
    d["tiers"][LOWER]["capacity_gb"] = _num(d["tiers"][LOWER]["capacity_gb"])
    for tier in (TOP, LOWER):
        for k in ("ttl_s", "ttl_shared_s"):
            d["tiers"][tier][k] = _num(d["tiers"][tier][k])
    import yaml

    d_dir = os.path.dirname(os.path.abspath(path))
    os.makedirs(d_dir, exist_ok=True)
    with open(path, "w") as f:
        f.write("".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()))
        yaml.safe_dump(d, f, sort_keys=False)
    return d


def _num(v):
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def write_json(path: str, res: dict) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


def plots(out_dir: str, grid: Sequence[dict], rec: dict) -> list[str]:
    """One PNG per tier, over the slice where that tier's capacity x TTL was searched
    (kvstore.tune.searched): this tier's hit rate, all tiers' hit rate and the bytes held against
    its TTL, one colour per capacity (NVMe: one line style per admit_after tried). Y axes start at
    0, but the all-tiers panel, whose axis is zoomed and says so; legends sit below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvstore.tune import searched as S

    os.makedirs(out_dir, exist_ok=True)
    s = setting(rec)
    files = []
    for tier, (ci, ti) in S.AXES.items():
        name = {TOP: "DRAM", LOWER: "NVMe"}[tier]
        key, pts = S.slice_of(grid, rec, tier)
        if not pts or all(setting(r)[ci] <= 0 for r in pts):
            continue
        series = {s[4]: pts}
        if tier == LOWER:
            series.update({a: rows for a, rows in S.admission(grid, rec).items() if a != s[4]})
        ttls = sorted({setting(r)[ti] for rows in series.values() for r in rows}, key=ttl_key)
        finite = [x for x in ttls if x is not None]
        none_x = max(finite) * 4 if finite else 1.0

        def xpos(ttl):
            return none_x if ttl is None else ttl

        fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 5))
        caps = sorted({setting(r)[ci] for r in pts if setting(r)[ci] > 0})
        colors = {c: f"C{i}" for i, c in enumerate(caps)}
        marks = {c: ("o", "s", "^", "D", "v")[i % 5] for i, c in enumerate(caps)}  # coinciding lines stay visible
        size = {c: 8 - 5 * i / max(1, len(caps) - 1) for i, c in enumerate(caps)}
        styles = ["-", "--", ":", "-."]
        alls = []
        for k, (adm, rows_a) in enumerate(series.items()):
            ls = styles[k % len(styles)]
            for cap in caps:
                rows = sorted((r for r in rows_a if setting(r)[ci] == cap), key=lambda r: ttl_key(setting(r)[ti]))
                if not rows:
                    continue
                xs = [xpos(setting(r)[ti]) for r in rows]
                tag = f"{cap:g} GB" + (f", admit_after {adm}" if len(series) > 1 else "")
                m = dict(marker=marks[cap], ms=size[cap], color=colors[cap])
                a1.plot(xs, [r["hit_rate_by_tier"][tier] * 100 for r in rows], ls, label=tag, **m)
                alls += [r["hit_rate"] * 100 for r in rows]
                a2.plot(xs, [r["hit_rate"] * 100 for r in rows], ls, **m)
                if k == 0:
                    a3.plot(xs, [r["bytes_held"][tier]["p50"] / (1 << 30) for r in rows], "-", **m)
                    a3.plot(xs, [r["bytes_held"][tier]["max"] / (1 << 30) for r in rows], ":", color=colors[cap])
        in_slice = s[ti] in ttls  # this tier's recommended TTL
        for ax in (a1, a2, a3):
            ax.set_xscale("log")
            ax.set_xticks([xpos(x) for x in ttls])
            ax.set_xticklabels([fmt_ttl(x) for x in ttls])
            ax.minorticks_off()
            ax.set_xlabel(f"{name} TTL (idle time before a block expires)")
            ax.grid(alpha=0.3)
            if in_slice:
                ax.axvline(xpos(s[ti]), color="grey", lw=0.8, ls="-.")
        top = max(r["hit_rate_by_tier"][tier] * 100 for rows in series.values() for r in rows)
        a1.set_ylim(0, max(1.0, top * 1.15))
        a1.set_ylabel(f"{name} hit rate (% of prompt tokens)")
        a1.set_title(f"served from {name}")
        lo, hi = min(alls), max(alls)
        bottom = max(0.0, lo - max(1.0, (hi - lo) * 0.5)) if hi - lo < 20 else 0.0
        a2.set_ylim(bottom, min(100.0, hi + max(1.0, (hi - lo) * 0.3)))
        a2.set_ylabel("hit rate, all tiers (%)" + (f"; y axis from {bottom:.0f}%, not 0" if bottom > 0 else ""))
        a2.set_title("served from any tier" + (" (zoomed)" if bottom > 0 else ""))
        a3.set_ylim(bottom=0)
        a3.set_ylabel(f"{name} bytes held (GiB): p50 solid, max dotted")
        a3.set_title(f"{name} bytes held" + (" (admit_after " + str(s[4]) + ")" if len(series) > 1 else ""))
        other = (f"NVMe {key[0]:g} GB, TTL {fmt_ttl(key[1])}, admit_after {key[2]}" if tier == TOP
                 else f"DRAM {key[0]:g} GB, TTL {fmt_ttl(key[1])}")
        n_ttl = len({setting(r)[ti] for r in pts})
        fig.suptitle(f"kvstore tune, {name}: {len(caps)} capacities x {n_ttl} TTLs searched at {other}"
                     + (f"; dash-dot: the recommended {name} TTL" if in_slice else ""))
        fig.legend(*a1.get_legend_handles_labels(), loc="lower center", ncol=min(6, len(caps) * len(series)),
                   fontsize=8, title="capacity" + (" and NVMe admission" if len(series) > 1 else ""),
                   title_fontsize=8)
        fig.tight_layout(rect=(0, 0.12 if len(series) > 1 else 0.09, 1, 1))
        f = os.path.join(out_dir, f"tune_{tier}.png")
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    return files
