"""``kvstore bench node``: the node cache (issue 46) through real vLLM engines on one host.

A ``kvstore serve`` daemon (DRAM and NVMe), and engines in processes of their own, one after the
other (two engines at once take longer to start on a 2-core machine than in turn):

* ``embedded``: one engine with its own store computes each prompt, its prefix cache is reset,
  and the same prompt is asked again: **the same engine's DRAM hit** (today's kvstore);
* ``node A``: an engine attached to the daemon (``mode: node``) computes the same prompts,
  storing them into the daemon's slab;
* ``node B``: a new engine process attached to the daemon asks them: **a cross-engine DRAM hit**
  (also what an engine restarted on a host finds).

Per prompt length (``--lengths``), ``--repeats`` fresh prompts after one warm-up prompt each.
Reported: each case's median TTFT, the median of the paired ratios node B ÷ embedded hit (goal
<= 1.1), B's cached tokens (every full block but the last token's) and whether B's greedy outputs
equal the embedded engine's; the daemon's DRAM blocks after A and B (the prompts once: 1x, where
two embedded engines hold 2x), and the daemon's CPU seconds per GiB stored (from /proc, while A
stores). Runs on a tiny random Llama built offline, like ``bench e2e``.

The no-reuse tax in node mode: before their TTFT prompts, the embedded engine and node A each run
the same ``--nr-batches`` batches of ``--nr-prompts`` distinct ``--nr-tokens``-token prompts (the
first a warm-up), every block stored and none reused: node A's throughput ÷ the embedded
engine's (the control path's round trips to the daemon against calls in the process).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid

import numpy as np

from kvstore.bench.common import engine_job, harness
from kvstore.bench.common.report import markdown_table

OUTPUT = 4  # tokens generated per request (the TTFT is the first)


def add_args(p) -> None:
    p.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens (comma separated)")
    p.add_argument("--repeats", type=int, default=5, help="fresh prompts per length")
    p.add_argument("--block-size", type=int, default=32, help="vLLM block size (a multiple of 32 on CPU)")
    p.add_argument("--dram-gb", type=float, default=0.5, help="the daemon's (and the embedded engine's) DRAM")
    p.add_argument("--nr-batches", type=int, default=5, help="no-reuse batches (the first a warm-up; 0: skip)")
    p.add_argument("--nr-prompts", type=int, default=8, help="no-reuse: distinct prompts a batch")
    p.add_argument("--nr-tokens", type=int, default=1024, help="no-reuse: tokens a prompt")
    p.add_argument("--dir", type=harness.folder, default=None, help="work folder (default: a temp folder)")
    harness.output_args(p, plots=False)


def _prompts(lengths: list[int], repeats: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(46)
    return {n: [[int(x) for x in rng.integers(4, 500, n)] for _ in range(repeats + 1)] for n in lengths}


def _job(job: dict) -> dict:
    """One engine's run (a child process): each length's warm-up prompt, then its prompts, with
    ``job["again"]``: each asked twice, vLLM's prefix cache reset between (the second is a hit)."""
    from kvstore.bench.common.engine import Engine, connector_config, kv_transfer
    from kvstore.offload import shared as shared_mod

    extra = connector_config(job["store"], dram_gb=job["dram_gb"], nvme_gb=4)
    extra.update(job.get("extra") or {})
    longest = max(int(n) for n in job["prompts"])
    eng = Engine(job["model"], block_size=job["block_size"], max_len=longest + 64, batched_tokens=longest + 64,
                 kv_transfer=kv_transfer(extra))
    out: dict = {"runs": {}, "no_reuse_s": []}
    try:
        for i, batch in enumerate(job.get("no_reuse") or []):
            t0 = time.monotonic()
            eng.batch(batch, OUTPUT)
            if i > 0:  # the first is a warm-up (a fresh engine's first batch of a shape is slow)
                out["no_reuse_s"].append(time.monotonic() - t0)
        for n, ps in job["prompts"].items():
            eng.batch([ps[0]], OUTPUT)  # warm-up of this length
            for sh in shared_mod.live():
                sh.store.wait_ready(120)
            runs = []
            for p in ps[1:]:
                r = eng.batch([p], OUTPUT)
                if job.get("again"):
                    for sh in shared_mod.live():
                        sh.store.flush()
                    eng.reset()
                    r = eng.batch([p], OUTPUT)
                runs.append({"ttft_s": r["ttft_s"][0], "cached": r["cached"][0], "outputs": r["outputs"][0]})
            out["runs"][n] = runs
        for sh in shared_mod.live():
            out["served_dram_tokens"] = sh.metrics.registry.get_sample_value(
                "kvstore_engine_served_tokens_total", {"tier": "dram"}) or 0.0
            out["dram_blocks"] = sh.store.stats()["tiers"].get("dram", {}).get("blocks")
            out["block_bytes"] = sh.store.block_bytes
    finally:
        eng.close()
    return out


def _spawn(name: str, job: dict, work: str) -> dict:
    """One engine's run (:func:`_job`) in a process of its own (bench/common/engine_job.py)."""
    return engine_job.spawn("kvstore.bench.node:_job", name, job, work, what="bench node")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(a) -> dict:
    from kvstore.bench.common.node_daemon import node_daemon
    from kvstore.bench.common.tiny_model import build_tiny_llama

    lengths = [int(x) for x in a.lengths.split(",")]
    work = a.dir or tempfile.mkdtemp(prefix="kvstore-bench-node-")
    model = build_tiny_llama(os.path.join(work, "model"), hidden=256, layers=4, seed=0)
    prompts = _prompts(lengths, a.repeats)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    cfg = {"tiers": {"dram": {"capacity_gb": a.dram_gb, "ttl_s": None},
                     "nvme": {"path": os.path.join(work, "daemon-nvme"), "capacity_gb": 4, "ttl_s": None}},
           "mode": "node", "node": {"name": name}}
    with open(os.path.join(work, "daemon.log"), "w") as daemon_log, node_daemon(cfg, work, daemon_log) as daemon:
        base = {"model": model, "block_size": a.block_size, "dram_gb": a.dram_gb,
                "prompts": {str(n): ps for n, ps in prompts.items()}}
        rng = np.random.default_rng(4600)
        nr = [[[int(x) for x in rng.integers(4, 500, a.nr_tokens)] for _ in range(a.nr_prompts)]
              for _ in range(a.nr_batches)]
        embedded = _spawn("embedded", {**base, "store": os.path.join(work, "embedded"), "again": True,
                                       "no_reuse": nr}, work)
        node = {"store": None, "extra": {"mode": "node", "node": {"name": name}}}
        # the model's store and slab are made at its first attach: a warm-up engine does that (and
        # stores the warm-up prompts), so the daemon's CPU while A stores is the stores' alone
        _spawn("node_warmup", {**base, **node, "prompts": {str(n): ps[:1] for n, ps in prompts.items()}}, work)
        cpu0 = _cpu_s(daemon.pid)
        node_a = _spawn("node_a", {**base, **node, "no_reuse": nr}, work)
        cpu_a = _cpu_s(daemon.pid) - cpu0
        node_b = _spawn("node_b", {**base, **node}, work)
    rows, ratios_all = [], []
    for n in lengths:
        e, b, na = embedded["runs"][str(n)], node_b["runs"][str(n)], node_a["runs"][str(n)]
        ratios = [y["ttft_s"] / x["ttft_s"] for x, y in zip(e, b)]
        ratios_all += ratios
        full = (n - 1) // a.block_size * a.block_size
        rows.append([n, f"{statistics.median(r['ttft_s'] for r in na) * 1e3:.1f}",
                     f"{statistics.median(r['ttft_s'] for r in e) * 1e3:.1f}",
                     f"{statistics.median(r['ttft_s'] for r in b) * 1e3:.1f}", f"{statistics.median(ratios):.2f}",
                     "yes" if all(r["cached"] == full for r in b) else "NO",
                     "yes" if all(x["outputs"] == y["outputs"] for x, y in zip(e, b)) else "NO"])
    # every full block is stored: the prompts', and node A's no-reuse batches' (warm-up included)
    stored_blocks = sum(n // a.block_size * (a.repeats + 1) for n in lengths) + \
        a.nr_batches * a.nr_prompts * (a.nr_tokens // a.block_size)
    a_gib = sum(n // a.block_size * a.repeats for n in lengths) * node_a["block_bytes"] / (1 << 30)
    res = {"lengths": lengths, "repeats": a.repeats, "rows": rows, "ratio_median": statistics.median(ratios_all),
           "daemon_dram_blocks_after_b": node_b.get("dram_blocks"), "prompt_blocks": stored_blocks,
           "daemon_cpu_s_while_a_stored": cpu_a,
           "a_stored_gib": a_gib, "daemon_cpu_s_per_stored_gib": cpu_a / a_gib if a_gib else None, "work": work,
           "no_reuse_s": {"embedded": embedded["no_reuse_s"], "node": node_a["no_reuse_s"]}}
    if embedded["no_reuse_s"] and node_a["no_reuse_s"]:  # throughput: the same tokens in less time
        res["no_reuse_node_over_embedded"] = statistics.median(embedded["no_reuse_s"]) / \
            statistics.median(node_a["no_reuse_s"])
    res["problems"] = [f"cross-engine hit / same-engine hit {res['ratio_median']:.2f} > 1.1"] \
        if res["ratio_median"] > 1.1 else []
    return harness.report(a, res, _render)


COLUMNS = ["tokens", "node A miss ms", "embedded DRAM hit ms", "node B hit ms", "B / embedded", "B all cached",
           "same output"]


def _render(res: dict) -> str:
    return "\n".join([
        markdown_table([dict(zip(COLUMNS, r)) for r in res["rows"]], COLUMNS),
        f"\nB / embedded, median of every paired ratio: {res['ratio_median']:.2f} (goal <= 1.1)",
        f"daemon DRAM blocks after A and B: {res['daemon_dram_blocks_after_b']} (the full blocks of every prompt A "
        f"and B sent, no-reuse batches included: {res['prompt_blocks']}; two embedded engines hold each twice)",
        f"daemon CPU while engine A stored {res['a_stored_gib']:.3f} GiB: {res['daemon_cpu_s_while_a_stored']:.2f} s "
        f"({res['daemon_cpu_s_per_stored_gib']:.2f} s a GiB; its requests' lookups and pins included)",
        *([f"no-reuse throughput, node A / embedded: {res['no_reuse_node_over_embedded']:.3f} (median batch "
           f"{statistics.median(res['no_reuse_s']['embedded']) * 1e3:.0f} ms embedded, "
           f"{statistics.median(res['no_reuse_s']['node']) * 1e3:.0f} ms node)"]
          if res.get("no_reuse_node_over_embedded") else [])])


def main(argv: list[str] | None = None) -> dict:
    """``python -m kvstore.bench.node``: parse ``argv`` as ``kvstore bench node`` would, then run."""
    return harness.main(__name__, argv)
