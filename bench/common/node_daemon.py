"""A ``kvstore serve`` process for the benchmarks that run engines on a node daemon
(``bench node``, ``bench route --node``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import yaml

from kvstore.bench.common.harness import stop_process


@contextlib.contextmanager
def node_daemon(cfg: dict, folder: str, log=None, wait_s: float = 120.0):
    """``kvstore serve`` on ``cfg`` (written to ``folder``/daemon.yaml), its output to ``log`` (a
    file; None: this process's stderr); yields the process once it answers, stops it (SIGTERM:
    DRAM written down) at the end."""
    from kvstore.config import from_dict
    from kvstore.node.probe import ping

    path = os.path.join(folder, "daemon.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    out = log if log is not None else sys.stderr
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.ops.cli", "serve", "--config", path], stdout=out,
                            stderr=subprocess.STDOUT if log is not None else sys.stderr)
    try:
        t0 = time.monotonic()
        while ping(from_dict(cfg)) != proc.pid:
            if proc.poll() is not None or time.monotonic() - t0 > wait_s:
                raise RuntimeError(f"kvstore serve did not start ({getattr(out, 'name', 'its log is above')})")
            time.sleep(0.1)
        yield proc
    finally:
        stop_process(proc, 120)
