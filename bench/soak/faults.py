"""The faults a soak injects on a schedule (``kvstore bench soak``), each on the real thing while
requests keep running: the Redis server killed and started again (empty) or flushed; block files
deleted or damaged under the engine; the NVMe tier's disk filled, then freed; the engine stopped
gracefully or killed -9 and started again; the node daemon killed -9 and started again.

The disk is a size-limited tmpfs where the soak may mount one (root); elsewhere the fill is the
``nvme.write=enospc`` failpoint through the control file every kvstore process reads (the same
errno at the same write, without the full filesystem), and the report says which.
"""

from __future__ import annotations

import errno
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore.bench.common.fault_files import damage

DOWN_S = 3.0  # how long a killed Redis or daemon stays down
FULL_S = 20.0  # how long the disk stays full


@dataclass
class Rig:
    server: object  # kvstore.bench.soak.server.Server
    redis: object | None  # redis_local.LocalRedis
    daemon: object | None  # kvstore.bench.soak.server.Daemon (node mode)
    nvme: str  # the NVMe tier's folder (the engine's, or the daemon's)
    disk: str | None  # the tmpfs it lies on, if mounted
    failpoints: str  # the failpoint control file the kvstore processes read
    seed: int = 0


def block_files(rig: Rig) -> list[Path]:
    return sorted(Path(rig.nvme).rglob("*.kvb"))


def redis_kill(rig: Rig) -> dict:
    rig.redis.kill()
    time.sleep(DOWN_S)
    rig.redis.restart()
    return {"down_s": DOWN_S}


def redis_flush(rig: Rig) -> dict:
    with rig.redis.client(socket_timeout=5) as c:
        keys = c.dbsize()
        c.flushall()
    return {"keys": keys}


def nvme_delete(rig: Rig, share: float = 0.3) -> dict:
    files = block_files(rig)
    pick = random.Random(rig.seed).sample(files, int(len(files) * share))
    n = 0
    for f in pick:
        try:
            f.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return {"files": len(files), "deleted": n}


def nvme_damage(rig: Rig, share: float = 0.2) -> dict:
    files = block_files(rig)
    pick = random.Random(rig.seed + 1).sample(files, int(len(files) * share))
    hows = ("payload", "header", "truncated", "replaced")
    n = 0
    for i, how in enumerate(hows):
        try:
            n += damage(pick[i::len(hows)], how)
        except OSError:  # a file the engine replaced or evicted meanwhile
            pass
    return {"files": len(files), "damaged": n}


def disk_full(rig: Rig) -> dict:
    if rig.disk is None:
        Path(rig.failpoints).write_text("nvme.write=enospc")
        time.sleep(FULL_S)
        Path(rig.failpoints).write_text("")
        return {"how": "failpoint nvme.write=enospc", "full_s": FULL_S}
    fill = Path(rig.disk) / "fill"
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(fill, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
                written += len(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    time.sleep(FULL_S)
    fill.unlink()
    return {"how": "tmpfs filled", "filled_mb": written >> 20, "full_s": FULL_S}


def engine_restart(rig: Rig) -> dict:
    """Out of rotation, SIGTERM (the requests in flight drain), started again, back in rotation."""
    rig.server.draining = True
    try:
        t0 = time.monotonic()
        clean = rig.server.stop()
        stop_s = time.monotonic() - t0
        start_s = rig.server.start()
    finally:
        rig.server.draining = False
    return {"stop_s": round(stop_s, 1), "clean": clean, "start_s": round(start_s, 1)}


def engine_kill(rig: Rig) -> dict:
    rig.server.kill()
    return {"start_s": round(rig.server.start(), 1)}


def daemon_kill(rig: Rig) -> dict:
    rig.daemon.kill()
    time.sleep(DOWN_S)
    return {"down_s": DOWN_S, "start_s": round(rig.daemon.start(), 1)}


# the order they come in: the engine's restarts first (the second half's slopes need processes
# that live through it), the node daemon's kill too; the disk and Redis later
FAULTS = {"engine_restart": engine_restart, "redis_kill": redis_kill, "nvme_delete": nvme_delete,
          "engine_kill": engine_kill, "daemon_kill": daemon_kill, "disk_full": disk_full,
          "redis_flush": redis_flush, "nvme_damage": nvme_damage}
# the series a fault starts again from a new level (a new process, an emptied store): their slope
# is fitted after the fault's end only
RESETS = {"engine_restart": ("server.", "engine.", "dram.", "daemon."),  # a daemon's threads serve each engine
          "engine_kill": ("server.", "engine.", "dram.", "daemon."),
          "daemon_kill": ("daemon.", "dram."), "redis_kill": ("redis.", "remote."), "redis_flush": ("redis.", "remote."),
          "nvme_delete": ("nvme.",), "nvme_damage": ("nvme.",), "disk_full": ("nvme.",)}


def applicable(node: bool, redis: bool) -> list[str]:
    return [f for f in FAULTS if (node or f != "daemon_kill") and (redis or not f.startswith("redis"))]
