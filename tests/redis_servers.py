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
(see its section below).
"""

from __future__ import annotations

import atexit
import secrets
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from bench.redis_local import free_port, launch, server_argv

_LIVE: set["Server"] = set()


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not on PATH")
    return path


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node one <= 55535 whose bus port (+10000) is free too."""
    if not cluster:
        return free_port()
    rng = secrets.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


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


# -- hostile fakes (issue 29) --------------------------------------------------------------
# Redis servers on loopback that a trust test points the remote tier at: real sockets that speak
# just enough RESP to be mistaken for Redis, then misbehave.
#
#     FakeRedis("trickle")    answers the handshake (HELLO, AUTH, CLIENT, SELECT; CLUSTER SLOTS and
#                             COMMAND as a cluster node when ``slots`` is set) at once, then every
#                             other reply one byte per ``gap`` s (a congested link, a hostile peer)
#     FakeRedis("slow_big")   the handshake at once, then a 2 MiB bulk string for every command, sent
#                             ``chunk`` bytes per ``gap`` s
#     FakeRedis("silent")     accepts, reads, never answers anything
#     FakeRedis("hello_ok")   answers HELLO with ``+OK`` (redis-py expects a map)
#     FakeRedis("garbage")    answers HELLO with bytes that are not RESP
#     FakeRedis("bad_int")    answers HELLO with an integer reply that is not a number
#     FakeRedis("bad_reply")  the handshake right, then every reply an integer that is not a number
#
# ``commands`` lists the command names received (upper case), so a test can tell that a call did
# reach the network. ``close()`` stops it and drops every connection.

MODES = ("trickle", "slow_big", "silent", "hello_ok", "garbage", "bad_int", "bad_reply")
_HANDSHAKE = {b"HELLO", b"AUTH", b"CLIENT", b"SELECT", b"CLUSTER", b"COMMAND"}
_HELLO_MAP = b"%3\r\n+server\r\n+redis\r\n+version\r\n+7.0.0\r\n+proto\r\n:3\r\n"
_BAD_HELLO = {"hello_ok": b"+OK\r\n", "garbage": b"\x00\xffnot resp at all\r\n", "bad_int": b":notanumber\r\n"}


def _reply(name: bytes, args: list[bytes], slots: list | None = None) -> bytes:
    """What a real server with no keys answers (the fake holds nothing)."""
    if name == b"CLUSTER" and slots:  # CLUSTER SLOTS: [start, end, [host, port, id]] per range
        out = b"*%d\r\n" % len(slots)
        for start, end, port in slots:
            out += b"*3\r\n:%d\r\n:%d\r\n*3\r\n$9\r\n127.0.0.1\r\n:%d\r\n$40\r\n%s\r\n" % (
                start, end, port, b"%040d" % port)
        return out
    if name == b"COMMAND":
        return b"*0\r\n"
    if name == b"HELLO":
        return _HELLO_MAP
    if name == b"CLIENT" and args[1:2] and args[1].upper() == b"MAINT_NOTIFICATIONS":
        return b"-ERR unknown subcommand\r\n"
    if name in (b"AUTH", b"CLIENT", b"SELECT", b"SET"):
        return b"+OK\r\n"
    if name == b"PING":
        return b"+PONG\r\n"
    if name in (b"GET", b"GETEX"):
        return b"$-1\r\n"
    if name == b"GETRANGE":
        return b"$0\r\n\r\n"
    if name == b"PTTL":
        return b":-2\r\n"
    return b":0\r\n"  # EXISTS, STRLEN, DEL, UNLINK, PEXPIRE


def _parse(buf: bytearray) -> list[bytes] | None:
    """One command (a RESP array of bulk strings) from the front of ``buf``, removed from it; None
    while it is incomplete."""
    if not buf.startswith(b"*"):
        end = buf.find(b"\r\n")
        if end < 0:
            return None
        line = bytes(buf[:end])
        del buf[:end + 2]
        return line.split()  # an inline command
    pos = buf.find(b"\r\n")
    if pos < 0:
        return None
    n, pos, args = int(buf[1:pos]), pos + 2, []
    for _ in range(n):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        size = int(buf[pos + 1:end])
        if len(buf) < end + 2 + size + 2:
            return None
        args.append(bytes(buf[end + 2:end + 2 + size]))
        pos = end + 2 + size + 2
    del buf[:pos]
    return args


class FakeRedis:
    def __init__(self, mode: str, *, gap: float = 0.15, chunk: int = 64 * 1024, big: int = 2 << 20):
        assert mode in MODES, mode
        self.mode, self.gap, self.chunk, self.big = mode, gap, chunk, big
        self.slots: list | None = None  # set: a cluster node answering CLUSTER SLOTS with these ranges
        self.commands: list[str] = []
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.05)
        self.port = self._sock.getsockname()[1]
        self._accept = threading.Thread(target=self._serve, name=f"fake-redis-{mode}", daemon=True)
        self._accept.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _send(self, conn: socket.socket, data: bytes, step: int) -> None:
        for i in range(0, len(data), step):
            if self._stop.wait(self.gap):
                return
            conn.sendall(data[i:i + step])

    def _handle(self, conn: socket.socket) -> None:
        buf = bytearray()
        conn.settimeout(0.05)
        try:
            while not self._stop.is_set():
                try:
                    data = conn.recv(1 << 20)
                except socket.timeout:
                    continue
                if not data:
                    return
                buf += data
                while (cmd := _parse(buf)) is not None:
                    name = cmd[0].upper() if cmd else b""
                    with self._lock:
                        self.commands.append(name.decode(errors="replace"))
                    if self.mode == "silent":
                        continue
                    if name == b"HELLO" and self.mode in _BAD_HELLO:
                        conn.sendall(_BAD_HELLO[self.mode])
                    elif name in _HANDSHAKE or self.mode in _BAD_HELLO:
                        conn.sendall(_reply(name, cmd, self.slots))
                    elif self.mode == "bad_reply":
                        conn.sendall(b":notanumber\r\n")
                    elif self.mode == "trickle":
                        self._send(conn, _reply(name, cmd), 1)
                    else:  # slow_big
                        self._send(conn, b"$%d\r\n" % self.big + bytes(self.big) + b"\r\n", self.chunk)
        except OSError:
            return
        finally:
            conn.close()

    def data_commands(self) -> list[str]:
        """The commands received past the handshake."""
        with self._lock:
            return [c for c in self.commands if c.encode() not in _HANDSHAKE]

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept.join(timeout=1)

    def __enter__(self) -> "FakeRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
