"""``kvstore tune``: replay a request trace over a grid of TTLs, capacities and NVMe admission
(``tiers.nvme.admit_after``), recommend a config.

    kvstore tune --trace T.jsonl [--dram-gb X] [--nvme-gb Y] [--model-shape L,H,D,DTYPE | --block-bytes B]
                 [--out CFG.yaml (--nvme-path DIR | --allow-temp-nvme)] [--json RES.json] [--plots DIR]

Its defaults come from the trace: a trace whose lines carry ``recorded`` (the config and KV block
of the store that recorded it: ``bench agent --trace-out`` writes it) gives the budget, the base
config and the block size. Without it, the budget is kvstore's defaults and the block a 7B-class
model's (128 KiB a token): both printed as assumptions; give ``--model-shape``. The report prints
every capacity and TTL it replayed (each slice where an axis was varied), the plots draw them.
A tuned YAML needs somewhere to put NVMe blocks: ``--out`` asks for ``--nvme-path`` (or a base or
recorded config with one), or ``--allow-temp-nvme`` for a private temporary folder.

Every setting is a replay of the trace through the store's own tier accounting
(kvstore.tiers.index.TierIndex + the policy registry, with the store's demotion and promotion rules)
on a virtual clock. The recommendation maximizes the prefill tokens saved within the budget
(or the net value under a cost model); among equally good settings it prefers the one serving
more from DRAM, then the smallest footprint. The YAML it writes is a complete config, usable
as ``kv_connector_extra_config.config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from kvstore.config import ConfigError, from_dict, read_yaml
from kvstore.trace import TraceError
from kvstore.tune import grid as G
from kvstore.tune import report as R
from kvstore.tune.recommend import CostModel, objective
from kvstore.tune.tuner import tune
from kvstore.tune.trace_memory import load_trace
from kvstore.tune.simulate import LOWER, NAMES, TOP

BYTES_PER_TOKEN = 128 << 10  # default KV bytes per token: an 8B GQA model in bf16 (32 layers x 8 KV heads x 128 x 2 x 2 B)


def _list(parse):
    def f(s: str):
        try:
            return [parse(x) for x in s.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return f


def _sample(s: str):
    if s == "auto":
        return s
    v = float(s)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"a sample rate must be in (0, 1] or auto, got {s!r}")
    return v


def _admit(s: str) -> int:
    v = int(s)
    if v < 0:
        raise ValueError(f"admit_after must be an integer >= 0, got {s!r}")
    return v


def _gb(s: str) -> float:
    v = float(s)
    if v < 0:
        raise ValueError(f"a capacity must be >= 0 GB, got {s!r}")
    return v


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="JSONL trace (see kvstore.trace; the connector records one "
                   "when trace_path is set)")
    p.add_argument("--dram-gb", type=_gb, default=None, help="DRAM budget, GiB (default: the base config's capacity)")
    p.add_argument("--nvme-gb", type=_gb, default=None, help="NVMe budget, GiB (default: the base config's capacity)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--model-shape", default=None, metavar="L,H,D,DTYPE",
                       help="the model's KV shape: layers,kv_heads,head_dim,dtype (e.g. 32,8,128,bfloat16); a "
                       "block is 2 x L x H x D x dtype bytes x the trace's block_tokens")
    shape.add_argument("--block-bytes", type=int, default=None,
                       help="bytes of one KV block (default: what the trace recorded, else --model-shape, else "
                       f"assumed: block_tokens x {BYTES_PER_TOKEN // 1024} KiB, a 7B-class model)")
    p.add_argument("--out", help="write the recommended config (YAML, the schema of configs/)")
    p.add_argument("--nvme-path", default=None, metavar="DIR", help="tiers.nvme.path of the YAML written "
                   "(default: the base's or the recorded one)")
    p.add_argument("--allow-temp-nvme", action="store_true", help="write the YAML without an NVMe path "
                   "(a private temporary folder: its blocks are gone at every restart)")
    p.add_argument("--json", help="write every grid point and the recommendation (JSON)")
    p.add_argument("--plots", help="folder for PNGs: hit rate and bytes held against TTL per tier")
    p.add_argument("--base", help="config (a path or a shipped name) whose other keys (path, codec, ...) the "
                   "output keeps; also the default budget and policies (default: the trace's recorded config)")
    g = p.add_argument_group("grid")
    g.add_argument("--dram-ttls", type=_list(R.parse_ttl), default=None,
                   help="DRAM TTLs (s, or with m/h/d; none = no expiry); default 30,60,2m,5m,10m,30m,1h,none")
    g.add_argument("--nvme-ttls", type=_list(R.parse_ttl), default=None,
                   help="NVMe TTLs; default 10m,30m,1h,4h,12h,1d,none")
    g.add_argument("--dram-gbs", type=_list(_gb), default=None, help="DRAM capacities (default: the budget x fractions)")
    g.add_argument("--nvme-gbs", type=_list(_gb), default=None, help="NVMe capacities (default: the budget x fractions)")
    g.add_argument("--fractions", type=_list(float), default=list(G.DEFAULT_FRACTIONS),
                   help="fractions of the budget tried as capacities (default 1,0.5,0.25)")
    g.add_argument("--admit-after", type=_list(_admit), default=None,
                   help="tiers.nvme.admit_after values tried (write a block to NVMe once N requests used it), "
                   f"on the NVMe slice at the pick; default {','.join(map(str, G.DEFAULT_ADMIT_AFTER))} and the "
                   "base's; 0 = today's grid only")
    g.add_argument("--search", choices=("auto", "full", "staged"), default="auto",
                   help="full: every combination; staged: DRAM slice then NVMe slice; auto: full when small")
    g.add_argument("--dram-policy", default=None, help="eviction policy (default: the base config's)")
    g.add_argument("--nvme-policy", default=None)
    g.add_argument("--dram-ttl-shared", type=R.parse_ttl, default=None,
                   help="TTL class: TTL of DRAM blocks hit by >= 2 sessions (ttl_shared_s; default: the base's)")
    g.add_argument("--nvme-ttl-shared", type=R.parse_ttl, default=None)
    g.add_argument("--tolerance-pp", type=float, default=0.1,
                   help="hit-rate points within which settings count as equally good (default 0.1)")
    c = p.add_argument_group("cost model (optional)")
    c.add_argument("--gb-hour-price-dram", type=float, default=0.0, help="price of one GB of DRAM held for an hour")
    c.add_argument("--gb-hour-price-nvme", type=float, default=0.0)
    c.add_argument("--prefill-token-price", type=float, default=0.0, help="price of computing one prefill token")
    g.add_argument("--sample", type=_sample, default="auto",
                   help="screen the grid on this fraction of the sessions (capacities scaled alike), then "
                   "replay the best settings on the whole trace; 1 = never; auto: when the search is large")
    g.add_argument("--confirm", type=int, default=None,
                   help="settings replayed on the whole trace after a sampled screening (default: max(2, jobs))")
    p.add_argument("--jobs", type=int, default=None, help="parallel processes (default: the cores available)")
    p.add_argument("--limit", type=int, default=None, help="use the first N requests only")
    p.add_argument("--all", action="store_true", help="print every grid point, not just the slices")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(argv: list[str] | None = None) -> int:
    from kvstore.ops.errors import Parser

    p = Parser(prog="kvstore tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    a = p.parse_args(argv)
    try:
        return _run(a)
    except OSError as e:  # the file's name and the reason, as the other commands say it (not "[Errno 2] ...")
        print(f"kvstore tune: error: {e.filename or ''}: {e.strerror or e}" if e.filename else
              f"kvstore tune: error: {e.strerror or e}", file=sys.stderr)
        return 2
    except (TraceError, ConfigError, ValueError) as e:
        print(f"kvstore tune: error: {e}", file=sys.stderr)
        return 2


def _sources(a, trace) -> tuple[dict, str, int, str]:
    """(base config data, where the budget comes from, block bytes, where they come from)."""
    rec = trace.recorded or {}
    by = rec.get("by", "its writer")
    if a.base:
        base, budget = read_yaml(a.base), f"--base {a.base}"
    elif rec.get("tiers"):
        base, budget = {"tiers": rec["tiers"]}, f"the config that recorded the trace ({by})"
    else:
        base, budget = {}, "kvstore's defaults: the trace does not record its config (--dram-gb/--nvme-gb or --base)"
    if a.dram_gb is not None or a.nvme_gb is not None:
        budget = "--dram-gb/--nvme-gb" if a.dram_gb is not None and a.nvme_gb is not None else \
            f"{'--dram-gb' if a.dram_gb is not None else '--nvme-gb'}, the other from {budget}"
    bt = max(trace.block_tokens)
    if a.block_bytes is not None:
        bb, how = a.block_bytes, "--block-bytes"
    elif a.model_shape:
        from kvstore.store.sizing import ModelShape

        shape = ModelShape.parse(a.model_shape)
        bb, how = shape.block_bytes(bt), f"--model-shape: {shape.describe()}, x {bt} tokens"
    elif rec.get("block_bytes"):
        bb, how = int(rec["block_bytes"]), f"recorded in the trace by {by}"
    else:
        bb = bt * BYTES_PER_TOKEN
        how = (f"assumed: {bt} tokens x {BYTES_PER_TOKEN >> 10} KiB, a 7B-class model (32 layers x 8 KV heads x 128 "
               "x 2 B); the trace does not record it: give --model-shape L,H,D,DTYPE")
    return base, budget, bb, how


def _run(a) -> int:
    t_start = time.perf_counter()
    trace = load_trace(a.trace, limit=a.limit)
    if not len(trace):
        raise ValueError(f"{a.trace}: no requests")
    t_load = time.perf_counter() - t_start
    base, budget_src, block_bytes, bb_src = _sources(a, trace)
    if a.nvme_path:
        from kvstore.config import merge

        base = merge(base, {"tiers": {LOWER: {"path": a.nvme_path}}})
    bcfg = from_dict(base)
    if block_bytes <= 0:
        raise ValueError(f"--block-bytes must be positive, got {block_bytes}")
    d, n = bcfg.tiers.dram, bcfg.tiers.nvme
    others = tuple((name, tuple(dataclasses.asdict(getattr(bcfg.tiers, name)).items())) for name in NAMES[2:]
                   if getattr(bcfg.tiers, name).enabled)  # modelled as the base has them (a shared folder)
    common = G.Common(block_bytes=block_bytes, dram_policy=a.dram_policy or d.policy,
                      nvme_policy=a.nvme_policy or n.policy,
                      dram_ttl_shared=a.dram_ttl_shared if a.dram_ttl_shared is not None else d.ttl_shared_s,
                      nvme_ttl_shared=a.nvme_ttl_shared if a.nvme_ttl_shared is not None else n.ttl_shared_s,
                      write_mode=n.write_mode, nvme_header="inline" if n.header == "inline" else "xattr",
                      dram_headroom=d.headroom_blocks, others=others)
    from kvstore.tiers.policy import POLICIES

    for pol in (common.dram_policy, common.nvme_policy):
        if pol not in POLICIES:
            raise ValueError(f"unknown policy {pol!r}; known: {', '.join(sorted(POLICIES))}")
    dram_budget = a.dram_gb if a.dram_gb is not None else (max(a.dram_gbs) if a.dram_gbs else d.capacity_gb)
    nvme_budget = a.nvme_gb if a.nvme_gb is not None else (max(a.nvme_gbs) if a.nvme_gbs else n.capacity_gb)
    if a.out and nvme_budget > 0 and n.path is None and not a.allow_temp_nvme:  # before the search, not after
        raise ValueError(f"--out {a.out}: the tuned config would have no tiers.nvme.path (neither the trace nor a "
                         "--base names one), so the store would keep NVMe blocks in a private temporary folder, "
                         "gone at every restart; give --nvme-path DIR, or --allow-temp-nvme to write it anyway")
    if bb_src.startswith("assumed"):
        print(f"kvstore tune: warning: block size {bb_src}", file=sys.stderr)
    dram_gbs = sorted({x for x in a.dram_gbs if x <= dram_budget}) if a.dram_gbs else G.capacities(dram_budget, a.fractions)
    nvme_gbs = sorted({x for x in a.nvme_gbs if x <= nvme_budget}) if a.nvme_gbs else G.capacities(nvme_budget, a.fractions)
    if not dram_gbs or not nvme_gbs:
        raise ValueError("no capacity within the budget to try (check --dram-gbs/--nvme-gbs against --dram-gb/--nvme-gb)")
    dram_ttls = G.sorted_ttls(a.dram_ttls or G.DEFAULT_DRAM_TTLS)
    nvme_ttls = G.sorted_ttls(a.nvme_ttls or G.DEFAULT_NVME_TTLS)
    if dram_budget <= 0:
        dram_ttls = dram_ttls[-1:]  # no DRAM tier: its TTL does not matter
    if nvme_budget <= 0:
        nvme_ttls = nvme_ttls[-1:]
    admits = sorted(set(a.admit_after)) if a.admit_after else sorted({*G.DEFAULT_ADMIT_AFTER, n.admit_after})
    if nvme_budget <= 0:
        admits = [n.admit_after]  # no NVMe tier: admission does not matter (the base's value is kept)
    cost = CostModel(a.gb_hour_price_dram, a.gb_hour_price_nvme, a.prefill_token_price)
    jobs = a.jobs or G.default_jobs()

    def progress(stage, done, total, simulated):
        if not a.quiet:
            print(f"\rkvstore tune: {stage}: {done}/{total} settings ({simulated} replayed)", end="",
                  file=sys.stderr, flush=True)
            if done == total:
                print(file=sys.stderr)

    out = tune(trace, common, (dram_gbs, dram_ttls, nvme_gbs, nvme_ttls, admits), search=a.search,
               sample=a.sample, jobs=jobs, cost=cost, tol_pp=a.tolerance_pp, confirm=a.confirm, progress=progress)
    rec, an = out["recommended"], out["analysis"]
    res = {
        "trace_path": a.trace,
        "trace": trace.summary(),
        "block_bytes": block_bytes,
        "budget": {"dram_gb": dram_budget, "nvme_gb": nvme_budget},
        "sources": {"budget": budget_src, "block_bytes": bb_src},
        "admit_after_tried": admits,
        "cost_model": {"gb_hour_price_dram": cost.gb_hour_dram, "gb_hour_price_nvme": cost.gb_hour_nvme,
                       "prefill_token_price": cost.prefill_token} if cost.active else None,
        "objective": "net value" if cost.active else "prefill tokens saved",
        **out,
        "capacity_binding": {t: an[t]["capacity_binding"] for t in (TOP, LOWER)},
        "modelled_as_configured": {name: dict(items) for name, items in others},
        "out": a.out,
    }
    res["timing"]["load_s"] = t_load
    if a.plots:
        res["plots"] = R.plots(a.plots, res["grid"], rec)
    if a.out:
        rt = rec["tiers"]
        header = (f"kvstore tune --trace {a.trace}: {trace.summary()['requests']} requests, "
                  f"budget DRAM {dram_budget:g} GB / NVMe {nvme_budget:g} GB, block {block_bytes} bytes\n"
                  f"recommended: DRAM {rt[TOP]['capacity_gb']:g} GB ttl {R.fmt_ttl(rt[TOP]['ttl_s'])}, "
                  f"NVMe {rt[LOWER]['capacity_gb']:g} GB ttl {R.fmt_ttl(rt[LOWER]['ttl_s'])} admit_after "
                  f"{rt[LOWER]['admit_after']}: hit rate {rec['hit_rate']:.1%}, "
                  f"{rec['saved_prefill_tokens']:,} prefill tokens saved "
                  f"({res['objective']}: {objective(rec, cost):,.6g})\n"
                  + "".join(f"{t}: {an[t]['detail']}\n" for t in (TOP, LOWER))
                  + "Usable as kv_connector_extra_config.config; check tiers.nvme.path.")
        R.write_yaml(a.out, rec, base, header)
    if a.json:
        R.write_json(a.json, res)
    print(R.markdown(res, all_rows=a.all), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
