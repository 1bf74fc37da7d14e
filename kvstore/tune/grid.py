"""The grid of settings (TTL and capacity per tier, NVMe admission) and its evaluation, in parallel
processes.

A setting is ``(dram_gb, dram_ttl, nvme_gb, nvme_ttl, admit_after)`` (a 4-tuple means admit_after
0: every block written to NVMe). Each one is a full replay of the trace
through :class:`~kvstore.tune.simulate.Simulator`. Work is skipped, exactly, where a replay
shows that a coordinate never mattered: if a tier never filled up (its capacity was never
consulted), every larger capacity gives the same run; if no entry of a tier was ever seen past
its TTL, every longer TTL does (admit_after is never skipped that way). Points are evaluated
in waves of increasing rank (the sum of their coordinates' positions), so each point's smaller
neighbours are known before it runs; a wave that leaves processes idle takes along the next
wave's likely replays (:meth:`Evaluator._ahead`).

Search modes: ``full`` (every combination), ``staged`` (DRAM TTL x capacity with NVMe at its
largest, then NVMe TTL x capacity with DRAM at the stage-1 pick: two slices instead of the
product), ``auto`` (full when it is small enough).
"""

from __future__ import annotations

import copy
import math
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.config import StoreConfig, from_dict
from kvstore.tune.simulate import Simulator, per_hour
from kvstore.tune.trace_memory import Trace
from kvstore.tune.simulate import LOWER, TOP

DEFAULT_DRAM_TTLS: tuple[float | None, ...] = (30, 60, 120, 300, 600, 1800, 3600, None)
DEFAULT_NVME_TTLS: tuple[float | None, ...] = (600, 1800, 3600, 4 * 3600, 12 * 3600, 86400, None)
DEFAULT_FRACTIONS = (1.0, 0.5, 0.25)
DEFAULT_ADMIT_AFTER = (0, 2)  # tiers.nvme.admit_after tried (1 is 0: a block's store is its first ask)
AUTO_FULL_LIMIT = 5_000_000  # request replays (points x requests) below which ``auto`` runs the full grid

Setting = tuple  # (dram_gb, dram_ttl, nvme_gb, nvme_ttl, admit_after)


def full_setting(s: Setting) -> Setting:
    """A 4-tuple setting with its admit_after (0) appended; a 5-tuple as it is."""
    return tuple(s) if len(s) >= 5 else tuple(s) + (0,)


@dataclass(frozen=True)
class Common:
    """What every point shares."""

    block_bytes: int
    dram_policy: str = "lru"
    nvme_policy: str = "lru"
    dram_ttl_shared: float | None = None
    nvme_ttl_shared: float | None = None
    write_mode: str = "write_back"
    nvme_header: str = "xattr"
    dram_headroom: int | str = "auto"  # tiers.dram.headroom_blocks (the live default)
    # the other media the replay models as the base config has them, never searched: (name, its
    # section's items), e.g. a shared folder below NVMe (its capacity scaled with a session sample)
    others: tuple = ()


def ttl_key(ttl: float | None) -> float:
    return math.inf if ttl is None else float(ttl)


def tiers_of(s: Setting, c: Common) -> dict:
    return {TOP: {"capacity_gb": s[0], "ttl_s": s[1], "ttl_shared_s": c.dram_ttl_shared, "policy": c.dram_policy,
                     "headroom_blocks": c.dram_headroom},
            LOWER: {"capacity_gb": s[2], "ttl_s": s[3], "ttl_shared_s": c.nvme_ttl_shared, "policy": c.nvme_policy,
                     "admit_after": full_setting(s)[4]}}


def config_of(s: Setting, c: Common, rate: float = 1.0) -> StoreConfig:
    """The store config a setting stands for (the tiers the tuner searches, at their settings,
    and the others as they are; ``rate``: a session sample's, scaling the others' capacities as
    the setting's are)."""
    t = tiers_of(s, c)
    t[LOWER] = {**t[LOWER], "write_mode": c.write_mode, "header": c.nvme_header}
    for name, items in c.others:
        sec = dict(items)
        t[name] = {**sec, "capacity_gb": sec["capacity_gb"] * rate} if "capacity_gb" in sec else sec
    return from_dict({"tiers": t})


def make_sim(s: Setting, c: Common, rate: float = 1.0, **kw) -> Simulator:
    return Simulator(config_of(s, c, rate), c.block_bytes, **kw)


def run_point(trace: Trace, s: Setting, c: Common, rate: float = 1.0) -> dict:
    """One replay. ``rate`` < 1: ``trace`` is a session sample of that rate; capacities are
    scaled down by it and counts scaled back up, so results read as full-trace estimates."""
    s = full_setting(s)
    sim = make_sim((s[0] * rate, s[1], s[2] * rate, s[3], s[4]), c, rate)
    req = sim.request
    t0 = time.perf_counter()
    for r in trace.requests():
        req(*r)
    out = sim.result()
    out["sim_seconds"] = time.perf_counter() - t0
    out["sim_requests"] = len(trace)
    out["simulated"] = True
    out["sample_rate"] = rate
    if rate != 1.0:
        _unscale(out, 1.0 / rate)
    out["tiers"] = tiers_of(s, c)
    _set_capacities(out, s, c)
    return out


_COUNTS = ("requests", "replay_requests", "prompt_tokens", "saved_prefill_tokens", "replay_hit_tokens",
           "genuine_hit_tokens", "lookup_tokens", "tail_tokens", "demotions", "promotions", "nvme_not_admitted",
           "nvme_written_bytes")
_COUNT_MAPS = ("hit_tokens_by_tier", "misses_by_reason", "evicted_for_capacity", "expired")


def _unscale(r: dict, f: float) -> None:
    for k in _COUNTS:
        r[k] = int(round(r[k] * f))
    for k in _COUNT_MAPS:
        r[k] = {a: int(round(v * f)) for a, v in r[k].items()}
    for h in r["bytes_held"].values():
        for k in ("p50", "p99", "max", "mean"):
            h[k] = h[k] * f
    r["nvme_written_bytes_per_hour"] = per_hour(r["nvme_written_bytes"], r["duration_s"])


def _set_capacities(r: dict, s: Setting, c: Common) -> None:
    """The full-size capacities (a sampled replay ran with them scaled down)."""
    sim = make_sim(s, c, record_samples=False)
    for name, held in r["bytes_held"].items():
        held["capacity"] = sim.tiers[name].capacity_bytes if name in sim.tiers else 0


# -- worker processes (fork: the trace is inherited, not pickled) ----------------------------------
_TRACE: Trace | None = None
_COMMON: Common | None = None


_RATE = 1.0


def _work(s: Setting) -> tuple[Setting, dict]:
    return s, run_point(_TRACE, s, _COMMON, _RATE)


class Evaluator:
    """Evaluates settings with reuse (see the module doc); ``jobs`` processes."""

    def __init__(self, trace: Trace, common: Common, axes: Sequence[Sequence], jobs: int = 1,
                 progress: Callable[[int, int, int], None] | None = None, rate: float = 1.0):
        self.trace, self.common, self.rate = trace, common, rate
        self.axes = [list(a) for a in axes] + [[0]] * (5 - len(axes))  # each sorted ascending (None TTL last)
        self.jobs = max(1, jobs)
        self.results: dict[Setting, dict] = {}
        self.simulated = 0
        self.copied = 0
        self.progress = progress
        self._pool = None

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def _map(self, todo: list[Setting]) -> list[tuple[Setting, dict]]:
        if self.jobs == 1 or len(todo) == 1 or "fork" not in mp.get_all_start_methods():
            return [(s, run_point(self.trace, s, self.common, self.rate)) for s in todo]
        if self._pool is None:
            global _TRACE, _COMMON, _RATE
            _TRACE, _COMMON, _RATE = self.trace, self.common, self.rate
            self._pool = mp.get_context("fork").Pool(self.jobs)
        return self._pool.map(_work, todo, chunksize=1)

    def _index(self, s: Setting) -> tuple[int, ...]:
        return tuple(ax.index(v) for ax, v in zip(self.axes, s))

    def _smaller(self, s: Setting, a: int, steps: int = 1) -> Setting | None:
        """``s`` with axis ``a`` ``steps`` positions smaller (None below the axis's first)."""
        i = self.axes[a].index(s[a]) - steps
        return None if i < 0 else s[:a] + (self.axes[a][i],) + s[a + 1:]

    @staticmethod
    def _consulted(r: dict, a: int) -> bool:
        """Did the replay ``r`` consult axis ``a`` (its tier's capacity or TTL)?"""
        return r["capacity_consulted" if a % 2 == 0 else "ttl_consulted"][TOP if a < 2 else LOWER]

    def _source(self, s: Setting) -> Setting | None:
        """An evaluated neighbour one step smaller on one axis that did not consult that axis."""
        for a in range(4):  # not admit_after: a larger one can turn blocks away that a smaller admits
            q = self._smaller(s, a)
            r = self.results.get(q) if q is not None else None
            if r is not None and not self._consulted(r, a):
                return q
        return None

    def _likely_replayed(self, s: Setting) -> bool:
        """Would ``s`` be replayed once its wave comes? Known where each smaller neighbour is
        known; a neighbour not yet known is taken to consult its axis as its own smaller neighbour
        on that axis did (unknown too: it does)."""
        for a in range(4):
            r = self.results.get(self._smaller(s, a))
            if r is None and self._smaller(s, a, 2) is not None:
                r = self.results.get(self._smaller(s, a, 2))
            if r is not None and not self._consulted(r, a):
                return False
        return True

    def _ahead(self, nxt: Sequence[Setting], n: int) -> list[Setting]:
        """Up to ``n`` settings of the next wave to replay now, on processes this wave leaves idle.

        The TTL axis is a chain (each TTL waits for the one below it: a wave is often one replay),
        so without this a 2-process search ran at 1.3 processes. A setting replayed ahead is the
        one its wave would have replayed, or an exact equal of the copy it would have taken
        (``tests/test_tune.py`` checks that copies equal replays); which ones go ahead depends only
        on the results known and ``jobs``, never on timing."""
        return [s for s in nxt if s not in self.results and self._likely_replayed(s)][:n]

    def evaluate(self, settings: Sequence[Setting]) -> list[dict]:
        settings = [full_setting(s) for s in settings]
        want = [s for s in dict.fromkeys(settings) if s not in self.results]
        waves: dict[int, list[Setting]] = {}
        for s in want:
            waves.setdefault(sum(self._index(s)), []).append(s)
        done = 0
        for rank in sorted(waves):
            todo = []
            for s in waves[rank]:
                if s in self.results:  # replayed ahead of its wave
                    continue
                q = self._source(s)
                if q is not None:
                    self.results[s] = _copy_result(self.results[q], s, self.common)
                    self.copied += 1
                    done += 1
                else:
                    todo.append(s)
            if todo and len(todo) < self.jobs:
                todo += self._ahead(waves.get(rank + 1, ()), self.jobs - len(todo))
            if todo:
                for s, r in self._map(todo):
                    self.results[s] = r
                    self.simulated += 1
                    done += 1
            if self.progress:
                self.progress(done, len(want), self.simulated)
        return [self.results[s] for s in settings]


def _copy_result(r: dict, s: Setting, c: Common) -> dict:
    out = copy.deepcopy(r)
    out["tiers"] = tiers_of(s, c)
    out["simulated"] = False  # identical to a smaller setting's replay (see the module doc)
    out["sim_seconds"] = 0.0
    _set_capacities(out, s, c)
    return out


def capacities(budget_gb: float, fractions: Sequence[float]) -> list[float]:
    return sorted({round(budget_gb * f, 6) for f in fractions})


def sorted_ttls(ttls: Sequence[float | None]) -> list[float | None]:
    return sorted(dict.fromkeys(ttls), key=ttl_key)


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover
        return max(1, os.cpu_count() or 1)
