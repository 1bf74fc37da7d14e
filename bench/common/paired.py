"""The statistic of ``kvstore bench tiers``: repeats interleaved, stalls re-run once, the median of
paired ratios (issue 50).

Each repeat of a row times the limit and then kvstore (and the peer) back to back, in a rotated
order, so one repeat's figures saw the same machine. About one timed phase in 15 on this project's
virtual disk stalls to 0.36-0.56 of its series' median, the limit's phases as often as kvstore's;
a median of three repeats cannot hide two stalls in a row, and a ratio of two medians pairs
figures from different moments. So:

* a phase whose throughput is under ``STALL`` of its own series' median is a stall: it is re-run
  once, the re-run's figure replaces it, and the row counts it (and whether the re-run stalled too);
* the row's ratio is the median over the repeats of (its GB/s / the same repeat's limit GB/s).
"""

from __future__ import annotations

import statistics
from typing import Sequence

STALL = 0.6
REPEATS = 5  # the default; fewer than MIN_FOR_STALLS finds no stall (a median of two says nothing)
MIN_FOR_STALLS = 3


def stalled(gbps: Sequence[float]) -> list[int]:
    """The positions of the throughputs under ``STALL`` x the series' median."""
    if len(gbps) < MIN_FOR_STALLS:
        return []
    m = statistics.median(gbps)
    return [i for i, g in enumerate(gbps) if g < STALL * m]


def paired_median(num: Sequence[float | None], den: Sequence[float | None]) -> float | None:
    """The median of ``num[i] / den[i]`` over the positions where both are measured."""
    xs = [a / b for a, b in zip(num, den) if a is not None and b]
    return statistics.median(xs) if xs else None


def rule(repeats: int) -> str:
    """The statistic in words, printed with the table."""
    stalls = (f"a phase under {STALL:g} of its series' median is a stall, re-run once (the stalls column: how "
              "many a row saw, and how many stalled again when re-run)") if repeats >= MIN_FOR_STALLS else \
        f"no stall rule (it needs at least {MIN_FOR_STALLS} repeats)"
    return (f"{repeats} repeat{'s' if repeats != 1 else ''} a row, kvstore and its limit back to back in each; "
            f"{stalls}; ratio = the median over the repeats of GB/s / the same repeat's limit GB/s.")
