"""The tables and plots of ``kvstore bench agent`` (bench/agent/)."""

from __future__ import annotations

import math

from kvstore.bench.common.report import Figures, markdown_table


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


def _ttl_tick(t: float | None) -> str:
    """A TTL in the unit a person says it in: 30 s, 5 min, 1 h, 1 day."""
    if t is None:
        return "none"
    for unit, s in (("day", 86400), ("h", 3600), ("min", 60)):
        if t >= s and t % s == 0:
            n = int(t // s)
            return f"{n} {unit}" + ("s" if unit == "day" and n > 1 else "")
    return f"{t:g} s"


def _zoom(ax, values: list[float], what: str) -> None:
    """A hit-rate axis: from 0, unless every value sits high; then zoomed, and the label says so."""
    lo, hi = min(values), max(values)
    bottom = 10 * math.floor((lo - 2) / 10) if lo > 40 else 0
    ax.set_ylim(bottom, 100)
    ax.set_ylabel(what + (f"\ny axis from {bottom}%, not 0" if bottom else ""))


def plot(data: dict, folder: str) -> list[str]:
    figs = Figures(folder)
    plt = figs.plt
    vs = list(data["variants"])
    block = (f"{data['block_tokens']}-token blocks of {data['kv_block_bytes'] / 2**20:.1f} MiB, "
             f"{data['kv_block_bytes'] // data['block_tokens'] // 1024} KiB of KV per token")
    fig, axes = plt.subplots(2, len(vs), figsize=(6.5 * len(vs), 8), squeeze=False, sharex="col")
    for j, v in enumerate(vs):
        w = data["variants"][v]["windows"]
        x = [(q["t_start_s"] + q["t_end_s"]) / 2 / 3600 for q in w]
        ax = axes[0][j]
        ax.plot(x, [100 * q["hit_rate"] for q in w], "k-o", ms=3, label="total")
        ax.plot(x, [100 * q["dram_hit_rate"] for q in w], "-", label="served from DRAM")
        ax.plot(x, [100 * q["nvme_hit_rate"] for q in w], "-", label="served from NVMe")
        ax.plot(x, [100 * q["replay_hit_rate"] for q in w], "--", label="replay hits (same prompt again)")
        ax.plot(x, [100 * q["genuine_hit_rate"] for q in w], ":", label="genuine hits (a new prompt's prefix)")
        ax.set_ylim(0, 100)
        ax.set_ylabel("token hit rate (%)")
        ax.set_title(f"{v}: hit rate over time (overall {100 * data['variants'][v]['hit_rate']:.1f}%)")
        ax.grid(alpha=0.3)
        ax = axes[1][j]
        ax.plot(x, [q.get("dram_gib", 0) for q in w], label="DRAM")
        ax.plot(x, [q.get("nvme_gib", 0) for q in w], label="NVMe")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{v}: bytes held (blue DRAM, orange NVMe)")
        ax.set_xlabel("virtual time (h since the first request)")
        ax.set_ylabel("bytes held (GiB, at the model's block size)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Agent workload through the store: {block}")
    h1, l1 = axes[0][0].get_legend_handles_labels()
    fig.legend(h1, l1, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    figs.save(fig, "agent_hit_rate.png", layout=False)
    if data["ttl_sweep"]:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
        finite = [r["ttl_s"] for r in data["ttl_sweep"] if r["ttl_s"] is not None]
        big = 4 * max(finite) if finite else 1e6
        ticks: dict = {}
        for series, label, col in (("nvme_ttl", "NVMe TTL varied, DRAM as configured", "C0"),
                                   ("dram_only_ttl", "DRAM TTL varied, no NVMe tier", "C1")):
            rows = [r for r in data["ttl_sweep"] if r["series"] == series]
            if not rows:
                continue
            xs = [r["ttl_s"] if r["ttl_s"] is not None else big for r in rows]
            ticks.update({x: r["ttl_s"] for x, r in zip(xs, rows)})
            ax.plot(xs, [100 * r["hit_rate"] for r in rows], "-o", color=col, label=label)
            key = "peak_nvme_gib" if series == "nvme_ttl" else "peak_dram_gib"
            ax2.plot(xs, [r[key] for r in rows], "-o", color=col,
                     label=f"peak {'NVMe' if series == 'nvme_ttl' else 'DRAM'} bytes held")
        for a in (ax, ax2):
            a.set_xscale("log")
            a.set_xticks(sorted(ticks))
            a.set_xticklabels([_ttl_tick(ticks[x]) for x in sorted(ticks)])
            a.minorticks_off()
            a.set_xlabel("idle TTL of the varied tier")
            a.grid(alpha=0.3)
        _zoom(ax, [100 * r["hit_rate"] for r in data["ttl_sweep"]], "token hit rate (%)")
        ax.set_title("hit rate")
        ax2.set_ylim(bottom=0)
        ax2.set_ylabel("peak bytes held (GiB, at the model's block size)")
        ax2.set_title("what that TTL holds")
        fig.suptitle(f"Hit rate vs TTL ({data['ttl_sweep'][0]['variant']} workload, {block})")
        h, l = ax.get_legend_handles_labels()
        fig.legend(h, l, loc="lower center", ncol=2, fontsize=8)
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        figs.save(fig, "agent_ttl_sweep.png", layout=False)
    return figs.paths
