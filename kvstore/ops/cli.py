"""The ``kvstore`` command: bench, tune, explain, inspect, stats, config."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _bench(argv: list[str]) -> int:
    """The benchmarks register themselves (pyproject's ``kvstore.bench`` entry points): the
    library never imports them by name, and another package can add a mode."""
    from importlib.metadata import entry_points

    modes = {ep.name: ep for ep in entry_points(group="kvstore.bench")}
    if not argv or argv[0] not in modes:
        have = ",".join(sorted(modes)) or "none installed: pip install -e ."
        print(f"usage: kvstore bench {{{have}}} [options]   (kvstore bench MODE --help)", file=sys.stderr)
        return 2
    mod = modes[argv[0]].load()
    p = argparse.ArgumentParser(prog=f"kvstore bench {argv[0]}", description=mod.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_args(p)
    r = mod.run(p.parse_args(argv[1:]))
    return 1 if isinstance(r, dict) and r.get("problems") else 0  # bench faults: what must not happen


def _inspect(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvstore inspect", description="What an NVMe tier folder, or the shared "
                                "remote tier (redis:// or rediss:// url), holds; read-only, from headers only. "
                                "Remote credentials come from KVSTORE_REDIS_USERNAME / KVSTORE_REDIS_PASSWORD "
                                "(a url that carries them is refused).")
    p.add_argument("dir", metavar="DIR|URL", help="the tier's path (the folder named in tiers.nvme.path), or "
                   "redis://host:port[/db] (rediss:// for TLS; with --cluster, seeds comma-separated)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--cluster", action="store_true", help="the url is a Redis Cluster seed (or several, "
                   "comma-separated); every master is scanned")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="remote: stop after N values "
                   "(default: all)")
    a = p.parse_args(argv)
    if a.dir.startswith(("redis://", "rediss://")):
        from kvstore.ops.inspect import inspect_remote, render

        info = inspect_remote(a.dir, cluster=a.cluster, limit=a.limit)
    else:
        from kvstore.ops.inspect import inspect_folder, render_folder as render

        if a.cluster or a.limit is not None:
            p.error("--cluster and --limit apply to a redis:// or rediss:// url")
        info = inspect_folder(a.dir)
    print(json.dumps(info, indent=2) if a.json else render(info))
    return 0


def _stats(argv: list[str]) -> int:
    from kvstore.ops.stats import fetch, render

    p = argparse.ArgumentParser(prog="kvstore stats", description="Hit rates, miss reasons and tier usage "
                                "of a running store, read from its Prometheus endpoint.")
    p.add_argument("--url", default="http://127.0.0.1:9400/metrics", help="the store's metrics URL")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    s = fetch(a.url)
    print(json.dumps(s, indent=2) if a.json else render(s))
    return 0


def _explain(argv: list[str]) -> int:
    from kvstore.ops.explain import explain_file
    from kvstore.ops.explain_report import plot, render
    from kvstore.trace import TraceError

    p = argparse.ArgumentParser(prog="kvstore explain", description="Why turns missed the cache: each session's "
                                "turns against the previous turn (head changed, history rewritten, expired or "
                                "evicted, append-only), read from a trace (trace_path).")
    p.add_argument("--trace", required=True, help="a JSONL trace (trace_path; trace_tokens: true gives tokens)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a plot: classes per session, "
                   "where turns diverged")
    p.add_argument("--examples", type=int, default=3, metavar="N", help="example turns per problem class")
    p.add_argument("--sessions", type=int, default=20, metavar="N", help="sessions listed (most lost first)")
    a = p.parse_args(argv)
    try:
        r = explain_file(a.trace, examples=a.examples, max_sessions=a.sessions)
    except (OSError, TraceError) as e:
        print(f"error: --trace {a.trace}: {e}", file=sys.stderr)
        return 1
    if a.plot:
        plot(r, a.plot)
    print(json.dumps(r, indent=2) if a.json else render(r))
    return 0


def _config(argv: list[str]) -> int:
    from kvstore.config import load_config
    from kvstore.store.machine import machine_errors

    p = argparse.ArgumentParser(prog="kvstore config", description="Validate a config (the file, KVSTORE__* "
                                "environment overrides, and what this machine can give it: memory for the DRAM "
                                "pool, a free metrics port, a usable NVMe folder) and print it resolved. Every bad "
                                "key is reported, one line each (exit 2).")
    p.add_argument("path", nargs="?", default=None, help="a YAML config (default: $KVSTORE_CONFIG, else defaults)")
    a = p.parse_args(argv)
    errors: list = []
    cfg = load_config(a.path, errors=errors)
    if cfg is not None:  # the machine's checks, for keys not already bad
        errors += [e for e in machine_errors(cfg) if e.key not in {x.key for x in errors}]
    for e in errors:
        print(f"kvstore config: error: {e}", file=sys.stderr)
    if errors:
        return 2
    print(cfg.to_yaml(), end="")
    return 0


def _tune(argv: list[str]) -> int:
    from kvstore.tune.cli import main as tune_main

    return tune_main(argv)


COMMANDS = {"bench": _bench, "inspect": _inspect, "stats": _stats, "config": _config, "tune": _tune,
            "explain": _explain}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: kvstore {bench,tune,explain,inspect,stats,config} ...\n\n"
              "  bench tiers      store/load throughput per tier vs. memcpy and O_DIRECT limits\n"
              "  bench agent      agent-workload replay through the store: hit rates, miss reasons\n"
              "  bench e2e        TTFT through vLLM: recompute vs prefix hits\n"
              "  bench copy       gather/scatter copy kernels vs memcpy (and PCIe on a GPU)\n"
              "  bench faults     crash/corruption/fuzz/disk-full/sharing/churn/bad-input suite (--quick)\n"
              "  tune --trace T   replay a trace over TTL/capacity settings, recommend a config\n"
              "  explain --trace T  why turns missed: head changed, history rewritten, expired/evicted\n"
              "  inspect DIR|URL  what an NVMe tier folder or a redis:// remote tier holds (--json)\n"
              "  stats            hit rates and miss reasons of a running store (--url)\n"
              "  config [PATH]    validate a config file and print it resolved", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
