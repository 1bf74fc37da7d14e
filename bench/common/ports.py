"""Free TCP ports for the servers that the benchmarks and tests start (Redis, vLLM's API, a store's
metrics endpoint, a KV-event publisher).

A port from ``bind(port 0)`` comes from the kernel's ephemeral range, the range that every outgoing
connection and every other ``bind(0)`` (vLLM's own ``get_open_port`` among them) draws from: between
the pick and the server's own bind, another process can take it. That made a fresh-clone CI red
once (``test_fault_matrix_on_a_hybrid_model``: "metrics.port ...: in use: something else listens on
it"). So these ports come from below the ephemeral range (10000 up to its start, read from
``/proc/sys/net/ipv4/ip_local_port_range``), drawn at random and checked free: nothing on the host
takes a port there unless a program names it.
"""

from __future__ import annotations

import random
import socket

LOW = 10000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_ports(n: int = 1, *, host: str = "127.0.0.1", span: int = 0) -> list[int]:
    """``n`` distinct ports nothing listens on, below the ephemeral range; with ``span``, each
    ``port + span`` is free too (a Redis cluster node's bus port) and below that range as well."""
    lo, hi = LOW, _ephemeral_start() - span
    if hi - lo < 1000:  # an ephemeral range that starts low: draw from all of them
        lo, hi = 1024, 65536 - span
    rng = random.SystemRandom()
    out: list[int] = []
    for _ in range(4000):
        if len(out) == n:
            return out
        p = rng.randrange(lo, hi)
        if p not in out and bindable(p, host) and (not span or bindable(p + span, host)):
            out.append(p)
    raise RuntimeError(f"no {n} free ports in [{lo}, {hi}) on {host}")


def free_port(host: str = "127.0.0.1", span: int = 0) -> int:
    return free_ports(1, host=host, span=span)[0]
