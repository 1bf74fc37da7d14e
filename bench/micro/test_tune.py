"""``kvstore tune``'s time on a 100,000-request agent trace (issue 48: at most 20 s on this kind of trace).

The trace is ``synth_records``' agent sessions at their defaults, 10,000 of them: a shared 4-block
system prompt, 10 turns each adding 2 blocks, 5-50 s between turns: 100,000 requests and 1.5 M
block visits (15 blocks a request). The search is ``kvstore tune --dram-gb 64 --nvme-gb 0
--block-bytes 2097152`` with its defaults (3 capacities x 8 TTLs), as many jobs as cores.

* ``test_tune_100k``: the whole tune, the trace already in memory (its loading is ~1.5 s more);
  one round (a round is several replays). The recommendation and the search's shape are in
  ``extra_info``, so two saved runs compare the same search.
* ``test_replay_per_block``: one replay of the first 10,000 requests at 64 GB and a 1 h TTL, the
  unit every search is made of (divide by ``extra_info['block_visits']`` for the cost per block).

Run: ``make microbench MICROBENCH_ARGS="-k tune"``.
"""

from __future__ import annotations

import pytest

from kvstore.config import from_dict
from kvstore.tune import grid as G
from kvstore.tune.recommend import setting
from kvstore.tune.trace_memory import Trace, from_records, synth_records
from kvstore.tune.tuner import tune

BLOCK_BYTES = 2 * 1024 * 1024


def _common() -> G.Common:
    """What ``kvstore tune`` builds from the default config (kvstore.tune.cli)."""
    d, n = from_dict({}).tiers.dram, from_dict({}).tiers.nvme
    return G.Common(block_bytes=BLOCK_BYTES, dram_policy=d.policy, nvme_policy=n.policy,
                    dram_ttl_shared=d.ttl_shared_s, nvme_ttl_shared=n.ttl_shared_s, write_mode=n.write_mode,
                    nvme_header="inline" if n.header == "inline" else "xattr", dram_headroom=d.headroom_blocks)


@pytest.fixture(scope="module")
def trace() -> Trace:
    return from_records(synth_records(sessions=10_000))


def test_tune_100k(benchmark, trace):
    axes = (G.capacities(64, G.DEFAULT_FRACTIONS), G.sorted_ttls(G.DEFAULT_DRAM_TTLS), [0.0], [None], [0])
    res = benchmark.pedantic(tune, args=(trace, _common(), axes), kwargs={"jobs": G.default_jobs()},
                             rounds=1, iterations=1)
    rec = res["recommended"]
    benchmark.extra_info.update(requests=len(trace), block_visits=trace.block_visits, recommended=list(setting(rec)),
                                hit_rate=rec["hit_rate"], sample_rate=res["sample_rate"], **res["timing"])
    assert len(trace) == 100_000 and rec["hit_rate"] > 0


def test_replay_per_block(benchmark, trace):
    first = from_records(synth_records(sessions=10_000)[:10_000])
    r = benchmark.pedantic(G.run_point, args=(first, (64.0, 3600.0, 0.0, None, 0), _common()), rounds=3,
                           iterations=1)
    benchmark.extra_info.update(requests=len(first), block_visits=first.block_visits, hit_rate=r["hit_rate"])
    assert r["hit_rate"] > 0
