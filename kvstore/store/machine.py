"""What this machine can give a config: memory for the DRAM pool, a free metrics port, a usable
NVMe folder. Each check returns a :class:`~kvstore.config.ConfigError` naming the key (or None).

Checked where the machine is the one that will run the store: at store start-up, before the
pool is made (:meth:`kvstore.store.KVStore.__init__` calls :func:`check_dram`; the metrics
port is refused by the real bind, :class:`kvstore.store.metrics.StoreMetrics`; the NVMe folder by
:func:`kvstore.tiers.nvme.folder.check_folder`), and by ``kvstore config FILE``
(:func:`machine_errors`, all at once). Never in :func:`kvstore.config.from_dict`: the tuner
builds and checks configs for other machines.

The DRAM pool is pre-faulted (and, with CUDA, pinned): it cannot be swapped or reclaimed, so a
pool bigger than the memory left brings the OOM killer, not a smaller cache (issue 29: 100000
GiB on a 21 GiB machine grew ~0.25 GiB/s until it came). The memory left is the lower of
``MemAvailable`` and the room under this process's memory cgroup limit (a container's limit,
which ``/proc/meminfo`` does not show), less what this process's own pools still prepare in
the background. The pool may take all of it but a headroom, max(1 GiB, 5 % of the machine's
memory), for the engine, the system and the page cache; a pool within it is never refused
later: the check is made once, at start-up.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Mapping

from kvstore.config import GiB, ConfigError, StoreConfig, load_config
from kvstore.tiers.dram.pool import unprepared_bytes
from kvstore.tiers.registry import SPECS

MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number (2**63 - 4096 here)
LOOPBACK = "127.0.0.1"  # metrics.host's default


def headroom_bytes(total: int) -> int:
    """Memory a DRAM pool leaves to everything else: max(1 GiB, 5 % of ``total``)."""
    return max(GiB, total // 20)


def meminfo(path: str = MEMINFO) -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``{"MemTotal": ..., "MemAvailable": ...}``); {} where unreadable."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read_int(p: Path, stat_key: str | None = None) -> int | None:
    try:
        text = p.read_text()
    except OSError:
        return None
    if stat_key is not None:
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == stat_key and v.strip().isdigit():
                return int(v)
        return 0
    text = text.strip()
    return int(text) if text.isdigit() else None


def cgroup_room(proc_cgroup: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> int | None:
    """Bytes this process's memory cgroup still gives before its limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``): the least over it and its ancestors of limit - usage + inactive
    file pages (page cache the kernel drops first). None where no level has a limit."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        if line.count(":") < 2:
            continue
        _, ctrls, rel = line.split(":", 2)
        if ctrls == "":  # v2 unified hierarchy
            base, files = Path(root), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in ctrls.split(","):
            base, files = Path(root) / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                  "total_inactive_file")
        else:
            continue
        d = base / rel.strip().lstrip("/")
        if not d.is_dir():  # a cgroup namespace shows "/" for the container's own: the mount's root
            d = base
        while True:
            limit = _read_int(d / files[0])
            usage = _read_int(d / files[1])
            if limit is not None and limit < NO_LIMIT and usage is not None:
                room = max(0, limit - usage + (_read_int(d / "memory.stat", files[2]) or 0))
                best = room if best is None else min(best, room)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return best


def available_memory() -> tuple[int, int, str] | None:
    """(bytes a new DRAM pool may still take before the headroom, the machine's total, what limits
    it, in words), or None where this machine does not say (no MemAvailable)."""
    info = meminfo()
    if "MemAvailable" not in info:
        return None
    free, what = info["MemAvailable"], f"{info['MemAvailable'] / GiB:.1f} GiB MemAvailable"
    room = cgroup_room()
    if room is not None and room < free:
        free, what = room, f"{room / GiB:.1f} GiB below this process's memory cgroup limit"
    pending = unprepared_bytes()
    if pending:
        free, what = free - pending, f"{what}, less {pending / GiB:.1f} GiB still being prepared for DRAM pools " \
                                     f"of this process"
    return free, info.get("MemTotal", free), what


def dram_error(cfg: StoreConfig) -> ConfigError | None:
    """``tiers.dram.capacity_gb`` more than this machine's available memory less the headroom."""
    d = cfg.tiers.dram
    avail = available_memory()
    if not d.enabled or avail is None:
        return None
    free, total, what = avail
    head = headroom_bytes(total)
    most = max(0, free - head)
    if d.capacity_bytes <= most:
        return None
    gb = int(d.capacity_gb) if d.capacity_gb.is_integer() else d.capacity_gb
    return ConfigError("tiers.dram.capacity_gb", gb, f"a number of GiB up to {most / GiB:.1f} (0: no DRAM tier)",
                       f"more than this machine's available memory: {what}, less {head / GiB:.1f} GiB left to "
                       f"the engine and the system; the pool is pre-faulted and never swapped")


def check_dram(cfg: StoreConfig) -> None:
    """Raise :func:`dram_error`'s error, if any (the store, before it makes the pool)."""
    e = dram_error(cfg)
    if e is not None:
        raise e


def port_refused(port: int, e: OSError, host: str = LOOPBACK) -> ConfigError:
    """The error for a metrics port this process cannot listen on at ``host`` (``e``: the bind's,
    or the name lookup's): ``metrics.host`` where the address is the problem, else ``metrics.port``."""
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return ConfigError("metrics.host", host, "an address of this machine (127.0.0.1, ::1; 0.0.0.0 or :: "
                           "for every interface) or a host name that resolves to one", e.strerror or str(e))
    why = {errno.EADDRINUSE: f"in use on {host}: something else listens on it",
           errno.EACCES: "a port below 1024 needs privileges"}
    return ConfigError("metrics.port", port, "a free port in [1, 65535] this process may listen on, or null",
                       why.get(e.errno, e.strerror or str(e)))


def listen_address(host: str, port: int) -> tuple[int, tuple]:
    """(family, sockaddr) the exporter binds for ``host``: the first of getaddrinfo, as
    prometheus_client's ``start_http_server(port, addr=host)`` picks it (raises socket.gaierror)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, sockaddr


def kvstore_exports(port: int, timeout: float = 1.0, host: str = LOOPBACK) -> bool:
    """Does another kvstore store (a rank or engine on this host) export its metrics on ``port``
    at ``host``? One GET of its /metrics (at loopback for 0.0.0.0 or ::); anything else there (or
    nothing answering) is not."""
    import http.client

    try:
        c = http.client.HTTPConnection({"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host), port, timeout=timeout)
        try:
            c.request("GET", "/metrics")
            r = c.getresponse()
            return r.status == 200 and b"kvstore_store_info" in r.read(1 << 22)
        finally:
            c.close()
    except (OSError, http.client.HTTPException):
        return False


def port_error(port: int | None, host: str = LOOPBACK) -> ConfigError | None:
    """``metrics.port`` that cannot be listened on at ``metrics.host`` now: a trial bind where and
    as the exporter binds (SO_REUSEADDR), closed at once. A port held on another address is no
    conflict (one held on 0.0.0.0 is). Held by another kvstore store (several ranks or engines on
    one host, one config): not an error (:meth:`StoreMetrics._serve` says so)."""
    if port is None:
        return None
    try:
        family, sockaddr = listen_address(host, port)
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        return port_refused(port, e, host)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(sockaddr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE and kvstore_exports(port, host=host):
            return None
        return port_refused(port, e, host)
    finally:
        s.close()
    return None


def tier_errors(cfg: StoreConfig) -> list[ConfigError]:
    """What each enabled medium's own check (its spec's ``check``: a folder it could not use, say)
    finds of this machine; creates nothing."""
    out = []
    for s in SPECS:
        section = getattr(cfg.tiers, s.name)
        if s.check is not None and section.enabled:
            out += s.check(section)
    return out


def _creatable(key: str, path: str, parent: Path, allowed: str) -> ConfigError | None:
    """``parent`` (the nearest existing one of ``path``) must be a folder this process can create in."""
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return ConfigError(key, path, allowed, f"{parent} is not a folder this process can write in")
    return None


def trace_error(cfg: StoreConfig) -> ConfigError | None:
    """``trace_path`` the connector could not open for appending (a folder, a device, a parent that
    is a file or not writable) or would refuse (a file of another user's, or open to group or
    others: :func:`kvstore.trace.not_private`); creates nothing. The connector opens it when it
    starts, after vLLM has loaded the model, so this is checked before."""
    t = cfg.trace_path
    if t is None:
        return None
    from kvstore.trace import TRACE_ALLOWED, not_private, own_link

    p = Path(t)
    try:
        if p.is_symlink() and not own_link(p):
            return ConfigError("trace_path", t, TRACE_ALLOWED,
                               "a symlink of another user's, which it never writes through")
        if p.exists():
            if not p.is_file():
                return ConfigError("trace_path", t, TRACE_ALLOWED, "it is not a regular file")
            why = not_private(p.stat())
            if why is not None:
                return ConfigError("trace_path", t, TRACE_ALLOWED, why)
            if not os.access(p, os.W_OK):
                return ConfigError("trace_path", t, TRACE_ALLOWED, "this process may not write it")
            return None
        parent = next(a for a in p.parents if a.exists())
    except OSError as e:
        return ConfigError("trace_path", t, TRACE_ALLOWED, str(e))
    return _creatable("trace_path", t, parent, TRACE_ALLOWED)


def machine_errors(cfg: StoreConfig) -> list[ConfigError]:
    """Every check above (for ``kvstore config``)."""
    return [e for e in (dram_error(cfg), port_error(cfg.metrics.port, cfg.metrics.host), *tier_errors(cfg),
                        trace_error(cfg)) if e is not None]


def config_errors(path: str | os.PathLike | None = None, overrides: Mapping | None = None, *,
                  ports: bool = True, daemon: bool = False) -> tuple[StoreConfig | None, list[ConfigError]]:
    """Every problem of a config at once, its keys' and this machine's: what ``kvstore config``
    prints, and what the vLLM plugin (``kvstore.connectors.vllm.register``) checks in the process
    that builds vLLM's config, before any model loads. (the config, or None where the file cannot
    be read; every error, one per key, in order).
    ``ports=False`` leaves ``metrics.port`` to the store's own bind (a process that will run a
    store of its own on that port must not find it "in use" by itself). ``daemon``: the config of
    ``kvstore serve``, whose tiers are checked whatever its ``mode``."""
    errors: list[ConfigError] = []
    cfg = load_config(path, overrides=overrides, errors=errors)
    if cfg is not None:  # the machine's checks, for keys not already bad
        bad = {e.key for e in errors}
        # mode node: an engine keeps no tier of its own (the daemon's config has them, and
        # `kvstore serve` checks that one), so its tiers section asks nothing of this machine
        tiers = [] if cfg.mode == "node" and not daemon else [dram_error(cfg), *tier_errors(cfg)]
        machine = tiers + [trace_error(cfg)]
        if ports:
            machine.append(port_error(cfg.metrics.port, cfg.metrics.host))
        errors += [e for e in machine if e is not None and e.key not in bad]
    return cfg, errors
