"""The search: which settings to replay, on the whole trace or on a session sample first.

* ``full``: every (DRAM capacity, DRAM TTL, NVMe capacity, NVMe TTL) combination.
* ``staged``: DRAM TTL x capacity with NVMe at its largest capacity and TTL; then NVMe TTL x
  capacity with DRAM at the stage-1 pick (the two slices instead of their product).
* ``auto``: ``full`` when it is at most ``work_limit`` block visits, else ``staged``.
* then, when there are several ``admit_after`` candidates (``tiers.nvme.admit_after``), the NVMe
  slice (capacity x TTL) at the pick so far is replayed for each other candidate (the search
  above runs at the first one): an admission filter changes what NVMe holds and how much is
  written to it, not what DRAM does.

Work is counted in block visits (requests x blocks per request). A replay is the store's own code
over stand-in tiers: 8-16 us a block visit on a 2-core VM, more the larger the tiers it keeps
(100,000 agent requests of 15 blocks at 64 GB of DRAM: about 21 s a replay). Sampling (``sample``
< 1, or ``auto`` when the grid's replays would visit more than ``screen_limit`` blocks): the grid
is screened on the requests of a hash-chosen fraction of the sessions with every capacity scaled
by that fraction (counts are scaled back up), then the best few settings (:func:`candidates`) are
replayed on the whole trace — or, when one whole-trace replay exceeds ``confirm_limit`` block
visits, on a larger session sample (``confirm_rate``) — and the recommendation is picked among
those, so its figures are the whole trace's. A screen's hit rates are off by up to a few points
(the sessions it drew), its ranking far less: on 100,000 agent requests, samples of 5 %, 8 % and
12 % of the sessions (3 hash seeds each) gave the whole trace's recommendation every time, as did
3 % to 20 % of a 30,000-request trace with hour-long pauses.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from kvstore.tune import grid as G
from kvstore.tune.recommend import CostModel, analyse, objective, pick, ranked, setting
from kvstore.tune.trace_memory import Trace

Setting = G.Setting

WORK_LIMIT = 100_000_000  # block visits of a full search past which ``auto`` searches in stages
SCREEN_LIMIT = 2_000_000  # block visits of a grid past which ``auto`` screens it on a session sample
# (about 20 CPU-s: 157 s -> 31-35 s on 100,000 agent requests, bench/micro/test_tune.py)
CONFIRM_LIMIT = 30_000_000  # block visits of one confirming replay before it is sampled too
MIN_SAMPLED_SESSIONS = 500  # a screen's fewest sessions (see the module doc)


def choose(n_requests: int, n_sessions: int, n_full: int, n_staged: int, search: str = "auto",
           sample: float | str = "auto", work_limit: int = WORK_LIMIT,
           n_visits: int | None = None, screen_limit: int = SCREEN_LIMIT) -> tuple[str, float]:
    """(search mode, sample rate) for a trace and grid; ``n_visits``: the trace's block visits
    (sum of blocks per request; default ``n_requests``, i.e. one block a request)."""
    unit = n_requests if n_visits is None else n_visits
    if search == "auto":
        search = "full" if n_full * unit <= work_limit else "staged"
    n_points = n_full if search == "full" else n_staged
    if sample == "auto":
        work = n_points * unit
        rate = 1.0 if work <= screen_limit else screen_limit / work
        if n_sessions:
            rate = max(rate, min(1.0, MIN_SAMPLED_SESSIONS / n_sessions))
        sample = 1.0 if rate > 0.5 else round(rate, 4)
    return search, float(sample)


def candidates(points: list[dict], cost: CostModel | None, tol_pp: float, k: int) -> list[Setting]:
    """The ``k`` settings a sampled screen sends to the whole trace: its best ``k`` in the pick's
    order, the last of them given up for the setting with the best objective if that is not
    among them (the pick prefers the smallest setting within ``tol_pp`` of the best; on a sample
    that small one can fall short of the best on the whole trace, and then the best must be
    there to be picked)."""
    out = [setting(r) for r in ranked(points, cost, tol_pp, k)]
    best = setting(max(points, key=lambda r: objective(r, cost)))
    if k >= 2 and best not in out:
        out[-1] = best
    return out


def tune(trace: Trace, common: G.Common, axes: Sequence[Sequence], *, search: str = "auto",
         sample: float | str = "auto", jobs: int = 1, cost: CostModel | None = None, tol_pp: float = 0.1,
         confirm: int | None = None, work_limit: int = WORK_LIMIT, confirm_limit: int = CONFIRM_LIMIT,
         screen_limit: int = SCREEN_LIMIT,
         progress: Callable[[str, int, int, int], None] | None = None) -> dict:
    """Run the search; returns the grid, the recommendation and its analysis (see cli for the keys)."""
    axes = [list(a) for a in axes] + [[0]] * (5 - len(axes))
    dram_gbs, dram_ttls, nvme_gbs, nvme_ttls, admits = axes
    a0 = admits[0]
    full = [(dc, dt, nc, nt, a0) for dc in dram_gbs for dt in dram_ttls for nc in nvme_gbs for nt in nvme_ttls]
    admission = [(nc, nt, a) for a in admits[1:] for nc in nvme_gbs if nc > 0 for nt in nvme_ttls]
    n_staged = len(dram_gbs) * len(dram_ttls) + len(nvme_gbs) * len(nvme_ttls) + len(admission)
    visits = trace.block_visits
    search, rate = choose(len(trace), trace.n_sessions, len(full) + len(admission), n_staged, search, sample,
                          work_limit, visits, screen_limit)
    screen = trace.sample_sessions(rate) if rate < 1 else trace
    if not len(screen):
        screen, rate = trace, 1.0
    t0 = time.perf_counter()

    def prog(stage):
        return (lambda d, t, s: progress(stage, d, t, s)) if progress else None

    with G.Evaluator(screen, common, axes, jobs=jobs, progress=prog("screen" if rate < 1 else "grid"),
                     rate=rate) as ev:
        if search == "full":
            ev.evaluate(full)
        else:
            stage1 = [(dc, dt, nvme_gbs[-1], nvme_ttls[-1], a0) for dc in dram_gbs for dt in dram_ttls]
            p1 = setting(pick(ev.evaluate(stage1), cost, tol_pp))
            ev.evaluate([(p1[0], p1[1], nc, nt, a0) for nc in nvme_gbs for nt in nvme_ttls])
        if admission:
            p2 = setting(pick(list(ev.results.values()), cost, tol_pp))
            ev.evaluate([(p2[0], p2[1], nc, nt, a) for nc, nt, a in admission])
        points = list(ev.results.values())
        simulated, reused = ev.simulated, ev.copied
    t_screen = time.perf_counter() - t0
    confirmed: list[dict] = []
    rec_screen = pick(points, cost, tol_pp)
    rec = rec_screen
    confirm_rate = 1.0
    if rate < 1:
        k = confirm if confirm is not None else max(2, jobs)
        cands = candidates(points, cost, tol_pp, k)
        confirm_rate = 1.0 if visits <= confirm_limit else max(rate, round(confirm_limit / visits, 4))
        target = trace.sample_sessions(confirm_rate) if confirm_rate < 1 else trace
        if not len(target):
            target, confirm_rate = trace, 1.0
        with G.Evaluator(target, common, axes, jobs=jobs, progress=prog("confirm"), rate=confirm_rate) as ev2:
            confirmed = ev2.evaluate(cands)
        rec = pick(confirmed, cost, tol_pp)
        rec_screen = next(r for r in points if setting(r) == setting(rec))
    seconds = time.perf_counter() - t0
    if cost is not None and cost.active:
        for r in points + confirmed:
            r["value"] = cost.value(r)
            r["storage_cost"] = cost.storage_cost(r)
    sims = [r for r in points + confirmed if r["simulated"]]
    sim_s = sum(r["sim_seconds"] for r in sims)
    sim_req = sum(r["sim_requests"] for r in sims)
    return {
        "search": search,
        "sample_rate": rate,
        "confirm_rate": confirm_rate if rate < 1 else None,
        "sampled_trace": screen.summary() if rate < 1 else None,
        "recommended": rec,
        "analysis": analyse(points, rec_screen, tol_pp),
        "grid": points,
        "confirmed": confirmed,
        "timing": {"seconds": seconds, "screen_s": t_screen, "simulated": simulated, "reused": reused,
                   "confirmed": len(confirmed), "jobs": jobs,
                   "requests_per_s": sim_req / sim_s if sim_s > 0 else 0.0,
                   "request_replays": sim_req},
    }
