"""What a soak watches: resources sampled over time, judged for unbounded growth, and plotted.

A soak (``kvstore bench soak``) runs vLLM with kvstore for minutes to an hour while faults happen.
A leak rarely fails a request; it shows as a number that keeps climbing. So every few seconds the
soak takes a ``sample()`` (per process: RSS, threads, open fds; the NVMe folder's files and MB;
Redis's keys and memory; kvstore's own block gauges and hit/error counters), adds it to a
``Track``, and at the end ``limits()`` fits a line through the second half of each resource (the
first half is warm-up: caches fill, pools grow) and fails the run when that line would add more
than a share of the resource's level, and more than an absolute floor, over another run as long.
``plot()`` draws the whole track with the fault times marked, for a person to read at a glance.

Times are seconds since the start of the run throughout.
"""

from __future__ import annotations

import math
import os
import urllib.request
from urllib.parse import urlsplit

import numpy as np

from kvstore.bench.common.report import Figures

MIN_FIT = 5  # fewer samples in the fitted window say nothing about a trend
MB = 1 << 20


# --- sampling -------------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children first), from each process's ppid in /proc/*/stat."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # it exited while we looked
            continue
        # the command name is in parentheses and may hold spaces or ")": split after the last ")"
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in sorted(kids.get(todo.pop(0), [])):
            out.append(c)
            todo.append(c)
    return out


def _proc(role: str, pid: int, out: dict) -> None:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            fields[k] = v.split()
    # a zombie (exited, not yet reaped) has no VmRSS: the KeyError leaves it out, as a dead pid
    out[f"{role}.rss_mb"] = int(fields["VmRSS"][0]) / 1024  # kB
    out[f"{role}.threads"] = float(fields["Threads"][0])
    out[f"{role}.fds"] = float(len(os.listdir(f"/proc/{pid}/fd")))


def _nvme(path: str, out: dict) -> None:
    files, size = 0, 0
    todo = [path]
    while todo:
        d = todo.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except FileNotFoundError:
            if d == path:
                raise  # no folder at all: no numbers, not zero
            continue  # a folder removed while we walked
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    size += e.stat(follow_symlinks=False).st_size  # lstat: a link is not the store's
                    files += 1
            except FileNotFoundError:  # a block file evicted while we walked
                continue
    out["nvme.files"], out["nvme.mb"] = float(files), size / MB


def _redis(url: str, out: dict) -> None:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw = {} if urlsplit(url).password else {"password": os.environ.get("KVSTORE_REDIS_PASSWORD") or None}
    # no retries: a hung server costs one socket_timeout per command, not four
    r = redis.Redis.from_url(url, socket_timeout=1, retry=Retry(NoBackoff(), 0), **kw)
    try:
        keys, used = r.dbsize(), r.info("memory")["used_memory"]
    finally:
        r.close()
    out["redis.keys"], out["redis.used_mb"] = float(keys), used / MB


# Prometheus sample name -> (our name, the labels that go into it); other labels are summed over
_METRICS = {
    "kvstore_tier_blocks": ("{tier}.blocks", ("tier",)),
    "kvstore_engine_served_tokens_total": ("served.{tier}", ("tier",)),
    "kvstore_engine_prompt_tokens_total": ("prompt_tokens", ()),
    "kvstore_engine_local_hit_tokens_total": ("local_hit_tokens", ()),
    "kvstore_tier_errors_total": ("errors.{tier}.{op}", ("tier", "op")),
}


def _metrics(url: str, out: dict) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    if "://" not in url:  # HOST:PORT, as `kvstore stats --url` takes it
        url = f"http://{url}/metrics"
    with urllib.request.urlopen(url, timeout=2) as resp:
        text = resp.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            # vLLM's /metrics carries the same as vllm:<name>; exact names skip a counter's _created
            m = _METRICS.get(s.name.removeprefix("vllm:"))
            if m is not None:
                key = m[0].format(**{k: s.labels.get(k, "") for k in m[1]})
                out[key] = out.get(key, 0.0) + s.value


def sample(procs: dict[str, int | None], *, nvme_path: str | None = None, redis_url: str | None = None,
           metrics_url: str | None = None) -> dict[str, float]:
    """One sample of named numbers. Never raises: the soak must outlive what it watches, so a
    source that fails (a dead pid, Redis down mid-fault, no metrics yet) just leaves its numbers
    out, all of them: a source is never half read."""
    out: dict[str, float] = {}
    jobs = [(_proc, role, pid) for role, pid in procs.items() if pid is not None]
    jobs += [(_nvme, nvme_path), (_redis, redis_url), (_metrics, metrics_url)]
    for fn, *args in jobs:
        if args[-1] is None:
            continue
        part: dict[str, float] = {}  # the source's numbers, kept only if it read to the end
        try:
            fn(*args, part)
        except Exception:  # noqa: BLE001 (see the docstring)
            continue
        out.update(part)
    return out


# --- the track and its judgement ------------------------------------------------------------

class Track:
    """Samples in time order: ``add(t, sample)``, ``series(name)``, JSON both ways."""

    def __init__(self):
        self.rows: list[tuple[float, dict[str, float]]] = []

    def add(self, t: float, sample: dict) -> None:
        # a NaN (no TTFT in an idle interval) is a missing number, and JSON has no NaN
        self.rows.append((float(t), {k: float(v) for k, v in sample.items() if math.isfinite(v)}))

    def names(self) -> list[str]:
        return sorted({k for _, s in self.rows for k in s})

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        pts = [(t, s[name]) for t, s in self.rows if name in s]
        return np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)

    def to_json(self) -> dict:
        return {"t": [t for t, _ in self.rows], "samples": [s for _, s in self.rows]}

    @classmethod
    def from_json(cls, d: dict) -> "Track":
        tr = cls()
        for t, s in zip(d["t"], d["samples"]):
            tr.add(t, s)
        return tr


def growth(ts, vs, *, run_s: float) -> dict:
    """The trend of one series over the second half of its samples by time: slope per minute,
    ``projected`` = growth over another ``run_s``, and the window's median. Too few samples (under
    5) give no slope, reason "too few"."""
    ts, vs = np.asarray(ts, float), np.asarray(vs, float)
    if len(ts) == 0:
        return {"n": 0, "slope_per_min": None, "projected": None, "median": None, "reason": "no samples"}
    keep = ts >= ts[0] + (ts[-1] - ts[0]) / 2
    ts, vs = ts[keep], vs[keep]
    row = {"n": int(len(ts)), "median": float(np.median(vs)), "slope_per_min": None, "projected": None}
    if len(ts) < MIN_FIT or ts[-1] == ts[0]:
        return {**row, "reason": f"too few samples ({len(ts)} < {MIN_FIT}) in the second half"}
    slope = float(np.polyfit(ts, vs, 1)[0])  # per second
    return {**row, "slope_per_min": slope * 60, "projected": slope * run_s, "reason": ""}


def _floor(name: str, floor: dict[str, float]) -> float:
    # keyed by the name's last part, longest matching ending: "rss_mb" before "mb" (redis.used_mb: "mb")
    last = name.rsplit(".", 1)[-1]
    keys = [k for k in floor if last.endswith(k)]
    return float(floor[max(keys, key=len)]) if keys else 0.0


def limits(track: Track, names: list[str], *, run_s: float, rel: float, floor: dict[str, float],
           since: dict[str, float] | None = None) -> list[dict]:
    """One row per name: name, slope_per_min, projected, median, limit, ok, reason (and n). A
    series fails when its projected growth over another run exceeds both ``rel`` x its median and
    the floor for its kind. ``since`` (name -> time its process last restarted): only the samples
    from then on are judged, a fresh process's warm-up being no leak; their second half is fitted,
    as for the run. Too few samples is reported, and not a failure."""
    rows = []
    for name in names:
        ts, vs = track.series(name)
        if since and name in since:
            keep = ts >= since[name]
            ts, vs = ts[keep], vs[keep]
        g = growth(ts, vs, run_s=run_s)
        limit = max(rel * g["median"], _floor(name, floor)) if g["median"] is not None else None
        ok, reason = True, g["reason"]
        if g["projected"] is not None:
            ok = g["projected"] <= limit
            reason = (f"{g['projected']:+.4g} over a run of {run_s / 60:.4g} min "
                      f"{'<=' if ok else '>'} limit {limit:.4g} (median {g['median']:.4g})")
        rows.append({"name": name, **g, "limit": limit, "ok": ok, "reason": reason})
    return rows


# --- the plot -------------------------------------------------------------------------------

def _increase(v: np.ndarray) -> np.ndarray:
    """Per-interval increase of a counter; a drop is a restart from zero (as Prometheus's rate)."""
    d = np.diff(v)
    return np.where(d < 0, v[1:], d)


def hit_rate(track: Track, *, window: int = 5) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per tier, kvstore's hit rate in % over time: served / (prompt - engine-local) tokens of the
    last ``window`` intervals (sums, not a mean of ratios: a quiet interval weighs little). NaN
    where nothing was asked."""
    rows = [(t, s) for t, s in track.rows if "prompt_tokens" in s]
    if len(rows) < 2:
        return {}
    ts = np.array([t for t, _ in rows])
    # a labelled counter shows only once it has counted something: absent is 0
    col = lambda k: np.array([s.get(k, 0.0) for _, s in rows])  # noqa: E731
    kern = np.ones(window)
    asked = np.convolve(_increase(col("prompt_tokens")) - _increase(col("local_hit_tokens")), kern)[:len(ts) - 1]
    out = {}
    for name in (n for n in track.names() if n.startswith("served.")):
        served = np.convolve(_increase(col(name)), kern)[:len(ts) - 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            out[name.split(".", 1)[1]] = (ts[1:], np.where(asked > 0, 100 * served / asked, np.nan))
    return out


def plot(track: Track, path: str, *, marks: list[tuple[float, str]] = (), title: str = "") -> None:
    """One PNG: a panel per resource kind (what the track has of it), fault times as labelled
    vertical lines on every panel, time in minutes."""
    figs = Figures(os.path.dirname(path) or ".")
    plt = figs.plt

    names = track.names()
    pick = lambda *pred: [n for n in names if any(p(n) for p in pred)]  # noqa: E731
    ends = lambda s: lambda n: n.endswith(s)  # noqa: E731
    is_ = lambda s: lambda n: n == s  # noqa: E731
    # (title, [(label, ts, vs)]); a panel with nothing to show is left out
    panels = [(t, [(n, *track.series(n)) for n in pick(*p)]) for t, p in [
        ("RSS (MB)", [ends(".rss_mb")]), ("threads", [ends(".threads")]), ("open fds", [ends(".fds")]),
        ("NVMe files", [is_("nvme.files")]), ("NVMe MB", [is_("nvme.mb")]), ("Redis keys", [is_("redis.keys")]),
        ("Redis MB", [is_("redis.used_mb")]), ("blocks held by kvstore", [ends(".blocks")]),
    ]]
    panels.append(("hit rate (%)", [(tier, *tv) for tier, tv in hit_rate(track).items()]))
    panels.append(("TTFT (ms)", [(n, *track.series(n)) for n in pick(lambda n: n.startswith("ttft."))]))
    panels.append(("errors (cumulative)", [(n, *track.series(n)) for n in pick(
        lambda n: n.startswith("errors."), lambda n: n == "requests.failed")]))
    panels = [p for p in panels if p[1]] or [("no samples", [])]
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.2 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (name, lines) in zip(axes.flat, panels):
        for label, ts, vs in lines:
            ax.plot(ts / 60, vs, lw=1.2, label=label)
        for t, label in marks:
            ax.axvline(t / 60, color="0.4", lw=0.8, ls="--")
            ax.text(t / 60, 0.98, f" {label}", transform=ax.get_xaxis_transform(), rotation=90,
                    va="top", ha="right", fontsize=6, color="0.3")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("minutes", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)  # from zero: noise on a flat line must not look like a climb
        if lines:
            ax.legend(fontsize=6, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97) if title else None)  # room for the title above the panels
    figs.save(fig, os.path.basename(path), layout=False, dpi=100)

