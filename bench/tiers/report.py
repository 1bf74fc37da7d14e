"""The table and plots of ``kvstore bench tiers`` (bench/tiers/)."""

from __future__ import annotations

import numpy as np

from kvstore.bench.common.paired import STALL, paired_median, rule
from kvstore.bench.common.report import Figures, markdown_table
from kvstore.bench.tiers.remote import REMOTE_HEADER


OPS = {"put_full": "put, full cache"}  # NVMe: every block written evicts one (bench/tiers/local.py)


def render(data: dict) -> str:
    L = data["limits"]
    head = (f"Reference limits (one 2-buffer copy / dd-style file, whole run size): memcpy {L['memcpy_gbps']:.2f} GB/s; "
            f"{'O_DIRECT' if L['o_direct'] else 'buffered+fsync'} sequential write {L['odirect_write_gbps']:.2f} GB/s, "
            f"read {L['odirect_read_gbps']:.2f} GB/s. Each row's own limit (same bytes, measured beside it) is in "
            f"its 'limit' columns; latency is per call of {data['params']['batch']} blocks "
            f"(fewer where a caller would otherwise have none: bench/tiers/ops.py, call_batch).\n")
    for what in data.get("kv_data", []):
        head += f"Block contents: {what}.\n"
    head += (rule(data["params"]["repeats"]) + " GB/s and limit GB/s are each their own series' median. comp = raw "
             "bytes / bytes the tier holds for them (files at their real size); cap x = blocks per GB vs codec none "
             "on the same tier.\n")
    if any(r["tier"].startswith("remote") for r in data["results"]):
        head += "remote rows: a stall is counted, not re-run (each repeat opens its own stores and Redis keys).\n"
    results = data["results"]
    rows = [{**r, "mib": r["block_bytes"] / 2**20, "op": OPS.get(r["op"], r["op"]),
             "ok": {True: "yes", False: "NO", None: "lossy, in bound"}[r["verified"]]
             + ("" if r.get("get_returned_min") in (None, r.get("blocks")) else
                f" (get returned {r['get_returned_min']}/{r['blocks']} blocks)"), "stalls": stalls_cell(r)}
            for r in results]
    cols = ["tier", "op", "codec", "block_tokens", "mib", "concurrency", "gbps", "limit", "limit_gbps", "ratio",
            "stalls", "comp_ratio", "capacity_gain", "p50_ms", "p99_ms", "ok"]
    names = ["tier", "op", "codec", "tokens/blk", "MiB/blk", "threads", "GB/s", "limit", "limit GB/s", "ratio",
             "stalls", "comp", "cap x", "p50 ms", "p99 ms", "bytes ok"]
    if any(r.get("path", "store") != "store" for r in results):
        for r in rows:
            eng = f" (engine {r['engine']})" if r.get("engine") else ""
            r["via"] = {"store": f"kvstore{eng}", "blockio": f"kvstore blockio{eng}",
                        "noengine": "kvstore (engine off)"}.get(r.get("path", "store"), r.get("path"))
        cols.insert(1, "via")
        names.insert(1, "store")
        cols.insert(cols.index("p50_ms"), "cpu_us_blk")
        names.insert(names.index("p50 ms"), "CPU us/blk")
    out = head + "\n" + markdown_table(rows, cols, names)
    peer = peer_table(results)
    if peer:
        out += (f"\n\nkvstore beside {data.get('peer') or 'the peer'} (its local CPU / disk backend, O_DIRECT on, driven "
                "as its StorageManager drives them; same bytes, threads, folder; interleaved, rotated order each "
                "repeat). Each store's ratio is to the same row's limit; x = the median over the repeats of kvstore's GB/s / "
                "LMCache's in the same repeat.\n\n" + peer)
        if data.get("peer_choices"):
            out += "\n\nHow the peer is driven, each choice and the side it favours:\n" + "\n".join(
                f"- {what}: favours {whom}" for what, whom in data["peer_choices"])
    if data.get("peer") and not peer:
        out += f"\n\nPeer: {data['peer']}"
    remote = [r for r in data["results"] if r["tier"] == "remote"]
    if remote:
        out += ("\n\nremote: limit = raw pipelined SET PX / GETEX PX of values of the store's size (block + "
                f"{REMOTE_HEADER}-byte header, built before timing), same client type, server, batch and threads; "
                "store put timed up to flush() (write-through done); store get with no local tier.")
        via = sorted({r["put_via"] for r in remote if r["op"] == "put"} - {"no local tier"})
        if via:
            out += (f"\nremote put measured through {', '.join(via)}: a put into a store with no local tier stored "
                    "nothing in Redis (the store writes Redis only as a write-through of a local tier).")
    if data.get("skipped"):
        seen = set()
        notes = []
        for s in data["skipped"]:
            k = (s["tier"], s["codec"])
            if s.get("path"):
                k = (s["tier"], s["codec"], s["path"])
            if k not in seen:
                seen.add(k)
                notes.append(f"- {s['tier']}{' ' + s['path'] if s.get('path') else ''} codec {s['codec']}: not "
                             f"measured ({s['error']})")
        out += "\n\nSkipped:\n" + "\n".join(notes)
    return out


def stalls_cell(r: dict) -> str:
    """How many phases of a row stalled, and how many stalled again when re-run (or were not re-run)."""
    st = r.get("stalls") or []
    if not st:
        return "0" if "stalls" in r else ""
    again = sum(1 for x in st if x.get("again") is None or x["again"] < STALL)
    return f"{len(st)} ({again} again)" if again else str(len(st))


def _x(a: dict, b: dict) -> float | None:
    """a's GB/s / b's: the median over the repeats of the two paths' figures in the same repeat."""
    x = paired_median(a.get("gbps_runs") or [], b.get("gbps_runs") or [])
    return x if x is not None else (a["gbps"] / b["gbps"] if b["gbps"] else None)


def peer_table(results: list[dict]) -> str:
    """One line per (tier, op, block, threads) with the peer measured: both stores' GB/s and ratios."""
    keyf = lambda r: (r["tier"], r["op"], r["block_tokens"], r["concurrency"])  # noqa: E731
    groups: dict = {}
    for r in results:
        if r.get("codec", "none") == "none":
            groups.setdefault(keyf(r), {})[r.get("path", "store")] = r
    lines = []
    for (tier, op, bt, c), g in groups.items():
        lm = g.get("lmcache")
        if lm is None or "store" not in g:
            continue
        kv, bio = g["store"], g.get("blockio")
        line = {"tier": tier, "op": op, "block_tokens": bt, "mib": kv["block_bytes"] / 2**20, "concurrency": c,
                "limit": kv["limit"], "limit_gbps": kv["limit_gbps"], "kv": kv["gbps"], "kv_ratio": kv["ratio"],
                "lm": lm["gbps"], "lm_ratio": lm["ratio"], "x": _x(kv, lm),
                "kv_cpu": kv.get("cpu_us_blk"), "lm_cpu": lm.get("cpu_us_blk"),
                "ok": "yes" if kv["verified"] and lm["verified"] else "NO"}
        if bio is not None:
            line.update({"bio": bio["gbps"], "bio_ratio": bio["ratio"], "bio_x": _x(bio, lm)})
        lines.append(line)
    if not lines:
        return ""
    cols = ["tier", "op", "block_tokens", "mib", "concurrency", "limit", "limit_gbps", "kv", "kv_ratio"]
    names = ["tier", "op", "tokens/blk", "MiB/blk", "threads", "limit", "limit GB/s", "kvstore GB/s", "ratio"]
    if any("bio" in ln for ln in lines):
        cols += ["bio", "bio_ratio"]
        names += ["blockio GB/s", "ratio"]
    cols += ["lm", "lm_ratio", "x"]
    names += ["LMCache GB/s", "ratio", "kvstore x"]
    if any("bio" in ln for ln in lines):
        cols.append("bio_x")
        names.append("blockio x")
    cols += ["kv_cpu", "lm_cpu"]
    names += ["kvstore CPU us/blk", "LMCache CPU us/blk"]
    return markdown_table(lines, cols + ["ok"], names + ["bytes ok"])


LIMIT_NAMES = {"dram": "memcpy of the same blocks", "nvme": "O_DIRECT write / read of the same bytes",
               "remote": "raw pipelined SET / GETEX of the same values"}


def _threads(c: int) -> str:
    return f"{c} caller thread{'s' if c != 1 else ''}"


def plot(data: dict, folder: str) -> list[str]:
    """tiers_gbps.png: per tier, kvstore's GB/s beside the limit measured on the same bytes in the
    same run (named in the title), one group per op, tokens per block and caller threads;
    tiers_latency.png: ms per call against tokens per block (16 to 256: the axis says so), one
    line per op and thread count. Legends sit below the panels, never over the data."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

    figs = Figures(folder)
    plt = figs.plt
    tiers = [t for t in ("dram", "nvme", "remote") if any(r["tier"] == t for r in data["results"])]
    if not tiers:
        return figs.paths
    name = {"dram": "DRAM", "nvme": "NVMe", "remote": "remote (Redis)"}
    n_max = max(sum(1 for r in data["results"] if r["tier"] == t and r.get("path", "store") == "store") for t in tiers)
    fig, axes = plt.subplots(len(tiers), 1, figsize=(max(11, 0.75 * n_max), 4.2 * len(tiers)), squeeze=False)
    for ax, tier in zip(axes[:, 0], tiers):
        rows = [r for r in data["results"] if r["tier"] == tier and r.get("path", "store") == "store"]
        labels = [f"{r['op']}\n{r['block_tokens']} tok\n{r['concurrency']} thr"
                  + ("" if r["codec"] == "none" else f"\n{r['codec']}") for r in rows]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r["gbps"] for r in rows], 0.4, color="C0", label="kvstore")
        ax.bar(x + 0.2, [r["limit_gbps"] for r in rows], 0.4, color="C7",
               label="the limit, measured on the same bytes right before (ratio = kvstore / limit above each pair)")
        top = max([max(r["gbps"], r["limit_gbps"]) for r in rows] or [1.0])
        for i, r in enumerate(rows):
            ax.text(i, max(r["gbps"], r["limit_gbps"]) + top * 0.01, f"{r['ratio']:.0%}", ha="center", va="bottom",
                    fontsize=7)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylim(0, top * 1.12)
        ax.set_ylabel("GB/s")
        ax.set_xlabel("op / tokens per block / caller threads" + (
            "   (put_full: a put into a full tier, each block replacing a victim's file)"
            if any(r["op"] == "put_full" for r in rows) else ""))
        ax.set_title(f"{name[tier]} tier vs. its limit: {LIMIT_NAMES[tier]}")
        ax.grid(axis="y", alpha=0.3)
    h, l = axes[0, 0].get_legend_handles_labels()
    fig.legend(h, l, loc="lower center", ncol=2, fontsize=8)
    fig.tight_layout(rect=(0, 0.05 / len(tiers) + 0.02, 1, 1))
    figs.save(fig, "tiers_gbps.png", layout=False)
    fig, axes = plt.subplots(1, len(tiers), figsize=(6.5 * len(tiers), 4.8), squeeze=False)
    handles: dict = {}
    for ax, tier in zip(axes[0], tiers):
        sizes = {}
        for i, op in enumerate(("put", "get")):
            for j, c in enumerate(sorted({r["concurrency"] for r in data["results"]})):
                rows = sorted([r for r in data["results"] if r["tier"] == tier and r["op"] == op
                               and r["concurrency"] == c and r["codec"] == "none" and r.get("path", "store") == "store"],
                              key=lambda r: r["block_tokens"])
                if not rows:
                    continue
                xs = [r["block_tokens"] for r in rows]
                sizes.update({r["block_tokens"]: r["block_bytes"] for r in rows})
                color = f"C{2 * i + j}"
                h50, = ax.plot(xs, [r["p50_ms"] for r in rows], "-o", color=color)
                ax.plot(xs, [r["p99_ms"] for r in rows], "--", color=color, alpha=0.7)
                handles[f"{op}, {_threads(c)}"] = h50
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(sizes))
        ax.set_xticklabels([f"{t}\n({sizes[t] / 2**20:g} MiB)" for t in sorted(sizes)])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("tokens per block (block size)")
        ax.set_ylabel(f"ms per call of up to {data['params']['batch']} blocks (log scale)")
        ax.set_title(f"{name[tier]} latency: p50 solid, p99 dashed")
        ax.grid(alpha=0.3, which="both")
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    figs.save(fig, "tiers_latency.png", layout=False)
    return figs.paths
