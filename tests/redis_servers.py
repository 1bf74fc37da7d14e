"""Real redis-server processes for tests (not a test module).

    start_single(tmpdir, password=None, maxmemory=None) -> Server
    start_cluster(tmpdir, masters=3, password=None)     -> Cluster   (no replicas)

Servers listen on free loopback ports, each in its own folder, with no persistence (``--save ""
--appendonly no``; a cluster node keeps only its ``nodes.conf``, so a restarted node rejoins with
its slots). ``kill()`` is SIGKILL, ``restart()`` starts again on the same port and folder,
``stop()`` kills and waits. A server dies with the test process (PR_SET_PDEATHSIG) and at exit.

Fixtures, for a test module to import (``from redis_servers import redis_single  # noqa: F401``):

    redis_single    a password-protected single server, fresh for each test
    redis_cluster   a 3-master cluster with a password, one per module (use distinct namespaces)
    redis_launcher  ``.single(password=, maxmemory=)`` / ``.cluster(masters=, password=)`` for a
                    test that needs its own (to kill, to fill); all stopped at its teardown

Everything is skipped cleanly where ``redis-server`` is not on PATH.

Hostile fakes (no redis-server needed): ``FakeRedis(mode)`` is a loopback server that speaks just
enough RESP to be taken for Redis and then trickles, stalls, or answers the handshake wrongly
(bench/faults/families/hostile.py, shared with the ``trust`` fault family; re-exported here).
"""

from __future__ import annotations

import atexit
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from kvstore.bench.faults.families.hostile import MODES, FakeRedis  # noqa: F401 (re-exported for the tests)
from kvstore.bench.common.redis_local import free_port, launch, server_argv

_LIVE: set["Server"] = set()


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not on PATH")
    return path


def _free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node one whose bus port (+10000) is free too."""
    return free_port(span=10000 if cluster else 0)


class Server:
    def __init__(self, folder: Path, *, password: str | None = None, maxmemory: int | str | None = None,
                 cluster: bool = False, port: int | None = None):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.maxmemory = maxmemory
        self.cluster = cluster
        self.port = port or _free_port(cluster)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self, **kw) -> redis.Redis:
        """A plain client to this one server (e.g. for DEBUG, TTL, INFO in a test)."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5, **kw)

    def _argv(self) -> list[str]:
        argv = server_argv(_require("redis-server"), self.port, self.dir, password=self.password,
                           maxmemory=self.maxmemory, policy="noeviction")
        argv += ["--enable-debug-command", "local"]  # DEBUG SLEEP: a slow server on demand
        if self.password and self.cluster:
            argv += ["--masterauth", self.password]
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000"]
        return argv

    def start(self, wait_s: float = 10.0) -> "Server":
        self.proc = launch(self._argv(), self.dir, lambda: self.client(socket_connect_timeout=0.2).ping(), wait_s)
        _LIVE.add(self)
        return self

    def kill(self) -> None:
        """SIGKILL, no goodbye (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def restart(self) -> "Server":
        """Start again on the same port and folder (its data is gone: no persistence)."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        self.kill()
        _LIVE.discard(self)


class Cluster:
    def __init__(self, servers: list[Server]):
        self.servers = servers
        self.password = servers[0].password

    @property
    def url(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.servers[0].port, password=self.password,
                                  socket_timeout=5)

    def node_of(self, key: bytes) -> Server:
        """The server that holds a key's slot (as the cluster reports it)."""
        rc = self.client()
        try:
            port = rc.get_node_from_key(key).port
        finally:
            rc.close()
        return next(s for s in self.servers if s.port == port)

    def wait_ok(self, wait_s: float = 20.0) -> "Cluster":
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if all(b"cluster_state:ok" in s.client().execute_command("CLUSTER", "INFO") for s in self.servers):
                    return self
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("cluster_state never became ok")
            time.sleep(0.05)

    def kill(self) -> None:
        for s in self.servers:
            s.kill()

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def start_single(tmpdir, password: str | None = None, maxmemory: int | str | None = None) -> Server:
    _require("redis-server")
    return Server(Path(tmpdir) / "redis-single", password=password, maxmemory=maxmemory).start()


def start_cluster(tmpdir, masters: int = 3, password: str | None = None) -> Cluster:
    """``masters`` nodes, the 16384 slots split evenly (CLUSTER ADDSLOTSRANGE), joined by CLUSTER
    MEET: faster than ``redis-cli --cluster create``, which sleeps a second per step."""
    _require("redis-server")
    servers = []
    try:
        for i in range(masters):
            servers.append(Server(Path(tmpdir) / f"redis-node{i}", password=password, cluster=True).start())
        bounds = [16384 * i // masters for i in range(masters + 1)]
        for i, s in enumerate(servers):
            c = s.client()
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", bounds[i], bounds[i + 1] - 1)
            if i:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", servers[0].port)
            c.close()
        return Cluster(servers).wait_ok()
    except BaseException:
        for s in servers:
            s.stop()
        raise


@atexit.register
def _stop_all() -> None:
    for s in list(_LIVE):
        s.stop()


@pytest.fixture
def redis_single(tmp_path):
    s = start_single(tmp_path, password=secrets.token_hex(12))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"), masters=3, password=secrets.token_hex(12))
    yield c
    c.stop()


class Launcher:
    """Starts servers for one test and stops every one of them at its teardown."""

    def __init__(self, tmp_path: Path):
        self.tmp = Path(tmp_path)
        self.started: list[Server | Cluster] = []

    def single(self, password: str | None = None, maxmemory: int | str | None = None) -> Server:
        s = start_single(self.tmp / f"s{len(self.started)}", password=password, maxmemory=maxmemory)
        self.started.append(s)
        return s

    def cluster(self, masters: int = 3, password: str | None = None) -> Cluster:
        c = start_cluster(self.tmp / f"c{len(self.started)}", masters=masters, password=password)
        self.started.append(c)
        return c

    def stop(self) -> None:
        for s in self.started:
            s.stop()


@pytest.fixture
def redis_launcher(tmp_path):
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.stop()
