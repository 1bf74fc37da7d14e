"""The ``kvstore`` command: bench, tune, explain, inspect, stats, config, size.

Conventions (kvstore.ops.errors): help on stdout; every expected failure is one line on stderr,
``kvstore <command>: error: ...``, never a traceback; exit 2 for bad input, 1 when the world
failed (a refused connection), 0 when done.
"""

from __future__ import annotations

import json
import logging
import sys
import urllib.error
import urllib.parse

from kvstore.ops.errors import BAD_INPUT, FAILED, CommandError, Parser

DEFAULT_STATS_URL = "http://127.0.0.1:9400/metrics"
USAGE = """usage: kvstore [--version] [--help] COMMAND [options]   (kvstore COMMAND --help)

  bench tiers        store/load throughput per tier beside the memcpy and O_DIRECT limits
  bench agent        agent-workload replay through the store: hit rates, miss reasons
  bench e2e          TTFT through vLLM: recompute vs prefix hits
  bench copy         gather/scatter copy kernels vs memcpy (and PCIe on a GPU)
  bench faults       crash/corruption/fuzz/disk-full/sharing/churn/bad-input suite (--quick)
  bench route        routing policies over several vLLM engines: hit rates, TTFT
  tune --trace T     replay a trace over TTL/capacity settings, recommend a config
  explain --trace T  why turns missed: head changed, history rewritten, expired/evicted
  inspect DIR|URL    what an NVMe tier folder or a redis:// remote tier holds (--json)
  stats [--url U]    hit rate and miss reasons of a running server (default """ + DEFAULT_STATS_URL + """)
  config [PATH|NAME] validate a config (a file, or a shipped name: agent, default) and print it resolved
  size               what a config keeps of a model: KV bytes per token, blocks and tokens per tier
  serve              the node daemon: one store per host, shared by every engine (mode: node)
"""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvstore")
    except Exception:  # noqa: BLE001 - running from a tree that is not installed
        return "unknown (not installed)"


def _parser(prog: str, description: str) -> Parser:
    return Parser(prog=f"kvstore {prog}", description=description)


def _bench(argv: list[str]) -> int:
    """The benchmarks register themselves (pyproject's ``kvstore.bench`` entry points): the
    library never imports them by name, and another package can add a mode."""
    import argparse
    from importlib.metadata import entry_points

    modes = {ep.name: ep for ep in entry_points(group="kvstore.bench")}
    have = ", ".join(sorted(modes)) or "none installed: pip install kvstore"
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: kvstore bench MODE [options]   (kvstore bench MODE --help)\n\nmodes: {have}")
        return 0
    if not argv:
        raise CommandError(f"a mode is required: {have} (kvstore bench MODE --help)")
    if argv[0] not in modes:
        raise CommandError(f"unknown mode {argv[0]!r}; modes: {have}")
    mod = modes[argv[0]].load()
    p = Parser(prog=f"kvstore bench {argv[0]}", description=mod.__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_args(p)
    a = p.parse_args(argv[1:])
    _check_codecs(p, a)
    try:
        r = mod.run(a)
    except SystemExit as e:  # a mode refusing a value: SystemExit("--tiers: unknown ...")
        if isinstance(e.code, str):
            raise CommandError(e.code) from None
        raise
    return FAILED if isinstance(r, dict) and r.get("problems") else 0  # bench faults: what must not happen


def _check_codecs(p: Parser, a) -> None:
    """``--codecs`` of any mode: names the store knows (``lz4`` was measured as nothing, exit 0)."""
    given = getattr(a, "codecs", None)
    if not isinstance(given, str):
        return
    from kvstore.codecs.registry import CODECS

    bad = [c for c in given.split(",") if c.strip() and c.strip() not in CODECS]
    if bad:
        p.error(f"argument --codecs: unknown codec(s) {', '.join(bad)}; known: {', '.join(CODECS)}")


def _inspect(argv: list[str]) -> int:
    p = _parser("inspect", "What an NVMe tier folder, or the shared remote tier (redis:// or rediss:// url), "
                "holds; read-only, from headers only. Remote credentials come from KVSTORE_REDIS_USERNAME / "
                "KVSTORE_REDIS_PASSWORD (a url that carries them is refused).")
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


def stats_url(url: str) -> str:
    """``127.0.0.1:9400`` or ``http://host:9400`` as the full metrics URL (``/metrics`` added)."""
    from urllib.parse import urlsplit

    u = url if "://" in url else f"http://{url}"
    s = urlsplit(u)
    if s.scheme not in ("http", "https") or not s.hostname:
        raise CommandError(f"--url {url!r}: expected http://HOST:PORT/metrics (or HOST:PORT)")
    try:
        s.port
    except ValueError as e:
        raise CommandError(f"--url {url!r}: {e}") from None
    return u if s.path not in ("", "/") else u.rstrip("/") + "/metrics"


def _stats(argv: list[str]) -> int:
    from kvstore.ops.stats import fetch, render

    p = _parser("stats", "Hit rate, miss reasons and tier usage of a running store, read from its Prometheus "
                "endpoint: the port in the config's metrics.port (e.g. kv_connector_extra_config "
                '{"metrics": {"port": 9400}}), served by the vLLM worker that holds the store.')
    p.add_argument("--url", default=DEFAULT_STATS_URL, help=f"the store's metrics URL, or HOST:PORT "
                   f"(default: {DEFAULT_STATS_URL}, i.e. metrics.port 9400 on this machine)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    url = stats_url(a.url)
    try:
        s = fetch(url)
    except urllib.error.HTTPError as e:
        raise CommandError(f"{url} answered HTTP {e.code} {e.reason}: not a kvstore metrics endpoint?", FAILED) \
            from None
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        port = urllib.parse.urlsplit(url).port or 80
        raise CommandError(f"cannot read {url}: {getattr(why, 'strerror', None) or why}; is a server running with "
                           f"metrics.port set to {port} (kv_connector_extra_config {{\"metrics\": {{\"port\": "
                           f"{port}}}}})?", FAILED) from None
    except ValueError as e:  # not Prometheus text
        raise CommandError(f"{url} did not answer Prometheus metrics ({e})", FAILED) from None
    if s["engine"] is None and not s["tiers"]:
        raise CommandError(f"{url} answered, but with no kvstore metrics: another exporter on that port?", FAILED)
    print(json.dumps(s, indent=2) if a.json else render(s))
    return 0


def _explain(argv: list[str]) -> int:
    from kvstore.ops.explain import explain_file
    from kvstore.ops.explain_report import plot, render

    p = _parser("explain", "Why turns missed the cache: each session's turns against the previous turn (head "
                "changed, history rewritten, expired or evicted, append-only), read from a trace (trace_path). "
                "What a trace does not record is reported as unknown, never as 0.")
    p.add_argument("--trace", required=True, help="a JSONL trace (trace_path; trace_tokens: true gives tokens)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a plot: classes per session, "
                   "where turns diverged")
    p.add_argument("--examples", type=int, default=3, metavar="N", help="example turns per problem class")
    p.add_argument("--sessions", type=int, default=20, metavar="N", help="sessions listed (most lost first)")
    a = p.parse_args(argv)
    r = explain_file(a.trace, examples=a.examples, max_sessions=a.sessions)
    if not r["requests"]:
        raise CommandError(f"--trace {a.trace}: the trace holds no requests (trace_path records one line per "
                           "finished request)")
    if a.plot:
        plot(r, a.plot)
    print(json.dumps(r, indent=2) if a.json else render(r))
    return 0


def _config(argv: list[str]) -> int:
    from kvstore.store.machine import config_errors

    p = _parser("config", "Validate a config (the file, KVSTORE__* environment overrides, and what this machine "
                "can give it: memory for the DRAM pool, a free metrics port, a usable NVMe folder) and print it "
                "resolved. Every bad key is reported, one line each (exit 2).")
    p.add_argument("path", nargs="?", default=None, metavar="PATH|NAME", help="a YAML config, or the name of a "
                   "shipped one (agent, default); default: $KVSTORE_CONFIG, else the defaults")
    a = p.parse_args(argv)
    cfg, errors = config_errors(a.path)
    for e in errors:
        print(f"kvstore config: error: {e}", file=sys.stderr)
    if errors:
        return BAD_INPUT
    print(cfg.to_yaml(), end="")
    return 0


def _size(argv: list[str]) -> int:
    from kvstore.store.machine import config_errors
    from kvstore.store.sizing import SHAPE_FORMAT, ModelShape, default_block_tokens, fmt_bytes, sizing_line

    p = _parser("size", "What a config keeps of a model. Rule of thumb: KV bytes per token = 2 (K, V) x layers x "
                "KV heads x head size x bytes per element; a tier keeps capacity / (bytes per token x block "
                "tokens) blocks.")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", metavar="DIR", help="a Hugging Face model folder (its config.json)")
    g.add_argument("--model-shape", metavar="L,H,D,DTYPE", help=SHAPE_FORMAT)
    p.add_argument("--dtype", default=None, help="with --model: the KV cache's dtype (vLLM's --dtype or "
                   "--kv-cache-dtype; default: what vLLM's --dtype auto runs, the model's torch_dtype with float32 "
                   "downcast to bfloat16)")
    p.add_argument("--block-tokens", type=int, default=None, help="tokens per KV block (vLLM --block-size; "
                   "default: vLLM's own here, 16 on a GPU, 128 on its CPU backend)")
    p.add_argument("--config", default=None, metavar="PATH|NAME", help="the config (default: $KVSTORE_CONFIG, "
                   "else the defaults)")
    p.add_argument("--keep-tokens", type=int, default=None, metavar="N", help="also: the capacity N tokens need")
    a = p.parse_args(argv)
    why_bt = None
    if a.block_tokens is None:
        a.block_tokens, why_bt = default_block_tokens()
    if a.block_tokens <= 0:
        p.error(f"argument --block-tokens: must be > 0, got {a.block_tokens}")
    try:
        shape = ModelShape.from_model_dir(a.model, a.dtype) if a.model else ModelShape.parse(a.model_shape)
    except ValueError as e:
        raise CommandError(str(e)) from None
    cfg, errors = config_errors(a.config, ports=False)
    if cfg is None:
        raise errors[0]
    bb = shape.block_bytes(a.block_tokens)
    print(f"KV per token: {shape.describe()}" + ("" if a.dtype or not a.model else " (vLLM's --dtype auto; --dtype "
                                                 "to change)"))
    print(f"a block of {a.block_tokens} tokens: {fmt_bytes(bb)}" + (f" ({why_bt}; --block-tokens to change)"
                                                                     if why_bt else ""))
    print(sizing_line(cfg, bb, a.block_tokens, a.model or "this model"))
    if a.keep_tokens is not None:
        print(f"to keep {a.keep_tokens:,} tokens: {fmt_bytes(a.keep_tokens * shape.bytes_per_token)}")
    for e in errors:
        print(f"kvstore size: warning: {e}", file=sys.stderr)
    return 0


def _serve(argv: list[str]) -> int:
    """The node daemon in the foreground, until SIGTERM or SIGINT (a graceful stop: DRAM is
    written down to NVMe). ``--ping``: exit 0 if a daemon answers (a readiness check)."""
    import signal
    import threading

    from kvstore.store.machine import config_errors

    p = _parser("serve", "One store per host, shared by every engine of the host (node mode: engines set "
                "`mode: node`). Runs in the foreground; SIGTERM or Ctrl-C stops it and writes DRAM down to NVMe. "
                "docs/node.md.")
    p.add_argument("--config", default=None, metavar="PATH|NAME", help="the daemon's config: its tiers are "
                   "every attached engine's (default: $KVSTORE_CONFIG, else the defaults)")
    p.add_argument("--ping", action="store_true", help="only check that a daemon answers (exit 0), else exit 1")
    a = p.parse_args(argv)
    cfg, errors = config_errors(a.config, daemon=True)
    for e in errors:
        print(f"kvstore serve: error: {e}", file=sys.stderr)
    if errors:
        return BAD_INPUT
    if a.ping:
        from kvstore.node.probe import ping

        pid = ping(cfg)
        if pid is None:
            raise CommandError(f"no daemon answers at {cfg.node.name}.sock", FAILED)
        print(f"kvstore serve: a daemon answers (pid {pid})")
        return 0
    from kvstore.node.daemon import NodeDaemon

    logging.getLogger("kvstore").setLevel(logging.INFO)
    try:
        d = NodeDaemon(cfg).start()
    except RuntimeError as e:  # another daemon serves the name, or the socket folder is refused
        raise CommandError(str(e), FAILED) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    logging.getLogger(__name__).warning("kvstore serve: stopping: writing DRAM down to NVMe")
    d.close(persist=True)
    return 0


def _tune(argv: list[str]) -> int:
    from kvstore.tune.cli import main as tune_main

    return tune_main(argv)


COMMANDS = {"bench": _bench, "inspect": _inspect, "stats": _stats, "config": _config, "tune": _tune,
            "explain": _explain, "size": _size, "serve": _serve}


def run(cmd: str, argv: list[str]) -> int:
    """One command, its expected failures turned into one line (see the module doc)."""
    from kvstore.config import ConfigError
    from kvstore.trace import TraceError

    prefix = f"kvstore {cmd}: error:"
    try:
        return COMMANDS[cmd](argv)
    except CommandError as e:
        print(f"{prefix} {e}", file=sys.stderr)
        return e.code
    except (ConfigError, TraceError) as e:
        print(f"{prefix} {e}", file=sys.stderr)
        return BAD_INPUT
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"{prefix} {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        print(f"{prefix} interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvstore ... | head`: the reader left; no traceback (Python's documented way)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return FAILED
    except SystemExit as e:  # argparse (help: 0, a bad option: 2); an int passes through
        if isinstance(e.code, str):
            print(f"{prefix} {e.code.removeprefix(f'kvstore {cmd}: ')}", file=sys.stderr)
            return BAD_INPUT
        return 0 if e.code is None else int(e.code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if argv and argv[0] == "--version":
        print(f"kvstore {_version()}")
        return 0
    if not argv:
        print(f"kvstore: error: a command is required: {', '.join(COMMANDS)} (kvstore --help)", file=sys.stderr)
        return BAD_INPUT
    if argv[0] not in COMMANDS:
        print(f"kvstore: error: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} (kvstore --help)",
              file=sys.stderr)
        return BAD_INPUT
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
