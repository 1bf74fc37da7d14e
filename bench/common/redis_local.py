"""A private ``redis-server`` for benchmarks (used when a bench is given no ``--redis-url``).

    with start() as r:          # a free loopback port, a temp folder, no persistence
        r.url                   # redis://127.0.0.1:PORT
        r.password              # None, or what --requirepass was given
    # stopped (terminate + wait), its temp folder removed

The server listens on 127.0.0.1 only, keeps nothing on disk (``--save "" --appendonly no``) and
dies with the process that started it (PR_SET_PDEATHSIG) or at its exit.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

_LIVE: set["LocalRedis"] = set()


def redis_server_path() -> str | None:
    return shutil.which("redis-server") or (("/usr/bin/redis-server") if os.path.exists("/usr/bin/redis-server")
                                            else None)


def available() -> bool:
    return redis_server_path() is not None


from kvstore.bench.common.harness import stop_process  # noqa: E402
from kvstore.bench.common.ports import free_port  # noqa: E402,F401 (the tests import it from here)


def die_with_parent() -> None:  # in the child before exec: no orphan server if its parent is killed
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def server_argv(exe: str, port: int, folder: str | Path, *, password: str | None = None,
                maxmemory: int | str | None = None, policy: str = "volatile-lru") -> list[str]:
    """A redis-server on 127.0.0.1:``port`` that keeps nothing on disk, logging to ``folder``/redis.log."""
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
            "--appendonly", "no", "--daemonize", "no", "--logfile", "redis.log"]
    if password:
        argv += ["--requirepass", password]
    if maxmemory is not None:
        argv += ["--maxmemory", str(maxmemory), "--maxmemory-policy", policy]
    return argv


def launch(argv: list[str], folder: str | Path, ping, wait_s: float = 10.0) -> subprocess.Popen:
    """Start ``argv`` in ``folder`` and wait until ``ping()`` answers; a server that exits (its
    log's tail in the error) or does not answer in ``wait_s`` is killed and raises."""
    import redis

    proc = subprocess.Popen(argv, cwd=folder, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    deadline = time.monotonic() + wait_s
    while True:
        if proc.poll() is not None:
            log = Path(folder) / "redis.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"redis-server ({' '.join(argv[1:3])}) exited ({proc.returncode}): {tail}")
        try:
            if ping():
                return proc
        except redis.RedisError:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise
        time.sleep(0.02)


class LocalRedis:
    def __init__(self, folder: str | Path | None = None, port: int | None = None, password: str | None = None,
                 maxmemory: int | str | None = None):
        exe = redis_server_path()
        if exe is None:
            raise RuntimeError("redis-server is not on PATH (install redis-server or valkey, or pass --redis-url)")
        self._tmp = None
        if folder is None:
            self._tmp = tempfile.mkdtemp(prefix="kvstore-redis-")
            folder = self._tmp
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = int(port) if port else free_port()
        self.password = password
        self.maxmemory = maxmemory
        self.argv = server_argv(exe, self.port, self.dir, password=password, maxmemory=maxmemory)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self, **kw):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **kw)

    def _start(self, wait_s: float = 10.0) -> "LocalRedis":
        def ping() -> bool:
            with self.client(socket_connect_timeout=0.2, socket_timeout=1) as c:
                return c.ping()

        try:
            self.proc = launch(self.argv, self.dir, ping, wait_s)
        except BaseException:
            self.stop()
            raise
        _LIVE.add(self)
        return self

    def stop(self) -> None:
        """Terminate the server and wait for it; remove the temp folder made for it."""
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            stop_process(p, 10)
        _LIVE.discard(self)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def kill(self) -> None:
        """SIGKILL the server (a crash: its keys are gone, it keeps nothing on disk)."""
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        _LIVE.discard(self)

    def restart(self) -> "LocalRedis":
        """Start it again, empty, on the same port and folder (after :meth:`kill`)."""
        return self._start()

    def __enter__(self) -> "LocalRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<LocalRedis {self.url} dir={self.dir}>"


def start(folder: str | Path | None = None, port: int | None = None, password: str | None = None,
          maxmemory: int | str | None = None) -> LocalRedis:
    """Start a private redis-server (free loopback port, temp folder unless ``folder``) and wait for PING."""
    return LocalRedis(folder, port, password, maxmemory)._start()


@atexit.register
def _stop_all() -> None:
    for r in list(_LIVE):
        r.stop()
