"""The ``trust`` family's local boundaries (issue 29; the family itself: :mod:`.trust`):

- ``hijacks``: another local user against the RPC socket: its folder made first by ``nobody``, a
  symbolic link, a 0755 folder of ours, a client of another uid (``SO_PEERCRED``), a socket of
  another uid at the store's name, a handle id taken from another connection or guessed
  (sequential ids). The ``nobody`` cases run in a forked child that drops to uid 65534 and need
  root: without it they are listed as skipped.
- ``bad_settings``: every bad setting of the issue, each through the door an operator uses (the
  store, ``load_config``, ``kvstore config``): refused with a ConfigError naming its key, never
  accepted, never another exception."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from kvstore.bench.faults.families.common import FP, REPO, block_of, key_of, open_store
from kvstore.config import ConfigError, from_dict, load_config
from kvstore.offload import rpc
from kvstore.offload.metrics import OffloadMetrics
from kvstore.offload.shared import SharedStore
from kvstore.offload.sockdir import SocketTrustError
from kvstore.store import KVStore

NOBODY = 65534
BB = 8192


@contextlib.contextmanager
def env(**values):
    """Environment variables set (None: unset) for the block, then restored."""
    def put(items) -> None:
        for k, v in items:
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    saved = [(k, os.environ.get(k)) for k in values]
    try:
        put(values.items())
        yield
    finally:
        put(saved)


def _tiny_store(**tiers) -> KVStore:
    cfg = {"dram": {"capacity_gb": 16 * BB / 2**30, "pin_memory": False}, "nvme": {"capacity_gb": 0}}
    cfg.update(tiers)
    return KVStore(from_dict({"tiers": cfg}), block_bytes=BB, fingerprint=FP, block_tokens=FP.block_size)


# -- hijacks -------------------------------------------------------------------------------------------
def as_nobody(child) -> int:
    """``child()`` in a forked process as uid/gid nobody; its return value is the exit status."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = child()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def hijacks(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    store = _tiny_store()
    shared = SharedStore(store, OffloadMetrics(store.metrics.registry))
    keys = [key_of("hijack", i) for i in range(4)]
    store.put(keys, np.stack([block_of(k, BB) for k in keys]))
    cases: list[dict] = []
    n = [0]

    def name() -> str:
        n[0] += 1
        return f"trust-{os.getpid()}-{n[0]}"

    def run(case: str, fn, needs_root: bool = False) -> None:
        if needs_root and os.getuid() != 0:
            cases.append({"case": case, "refused": None, "how": "skipped: not root"})
            return
        d = tempfile.mkdtemp(prefix="kvs-trust-", dir="/tmp")  # $XDG_RUNTIME_DIR; in /tmp nobody can reach it
        try:
            with env(XDG_RUNTIME_DIR=d):
                refused, how = fn(os.path.join(d, f"kvstore-{os.getuid()}"), name())
        except Exception as e:
            refused, how = False, f"UNEXPECTED {type(e).__name__}: {e}"
        finally:
            shutil.rmtree(d, ignore_errors=True)
        cases.append({"case": case, "refused": refused, "how": str(how)[:240]})

    def both_refuse(sock_dir: str, n: str, inside: str | None = None) -> tuple[bool, str]:
        """The store's server and the scheduler's client both refuse the folder, and leave nothing in it."""
        for what, make in (("server", lambda: rpc.StoreServer(shared, n)),
                           ("client", lambda: rpc.RemoteClient(n, connect_timeout_s=5))):
            try:
                make().close()
            except SocketTrustError as e:
                how = str(e)
                continue
            return False, f"the {what} used {sock_dir}"
        return os.listdir(inside or sock_dir) == [], how

    def made_by_nobody(d, n):
        os.mkdir(d)
        os.chown(d, NOBODY, NOBODY)
        os.chmod(d, 0o777)
        return both_refuse(d, n)

    def symlinked(d, n):
        target = tempfile.mkdtemp(dir=os.path.dirname(d))  # a private folder, even one of ours
        os.symlink(target, d)
        return both_refuse(d, n, inside=target)

    def loose(d, n):
        os.mkdir(d)
        os.chmod(d, 0o755)
        return both_refuse(d, n)

    def client_of_nobody(d, n):
        """The folder opened by mistake (0711, the socket 0777): SO_PEERCRED still refuses nobody."""
        server = rpc.StoreServer(shared, n)
        try:
            for p, m in ((os.path.dirname(d), 0o711), (d, 0o711), (server.path, 0o777)):
                os.chmod(p, m)
            code = as_nobody(lambda: _ping(server.path))
            if code == 2:
                return None, "nobody could not connect: not tried"
            return code == 0 and server.refused["uid"] == 1, f"exit {code}, refused {server.refused}"
        finally:
            server.close()

    def server_of_nobody(d, n):
        """nobody's socket moved to the store's name: the scheduler's client refuses to talk to it."""
        os.mkdir(d, 0o700)
        pub = tempfile.mkdtemp(prefix="kvs-pub-", dir="/tmp")
        os.chmod(pub, 0o777)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                os.close(r)
                code = _evil_server(pub, w)
            finally:
                os._exit(code)
        os.close(w)
        try:
            if os.read(r, 1) != b"1":
                return None, "nobody's server did not start: not tried"
            os.rename(os.path.join(pub, "evil.sock"), os.path.join(d, rpc.socket_name(n)))
            try:
                rpc.RemoteClient(n, connect_timeout_s=5).close()
            except SocketTrustError as e:
                return True, str(e)
            return False, "the client talked to nobody's server"
        finally:
            os.close(r)
            os.waitpid(pid, 0)  # it accepted the client's connection (or gave up after 10 s)
            shutil.rmtree(pub, ignore_errors=True)

    def handles(d, n, guess: bool):
        server = rpc.StoreServer(shared, n)
        a, b = rpc.RemoteClient(n, connect_timeout_s=5), rpc.RemoteClient(n, connect_timeout_s=5)
        try:
            hid = a.begin_load(keys)[0]
            tries = list(range(1, 9)) if guess else [hid]  # the ids were 1, 2, 3... before issue 29
            taken = []
            for t in tries:
                try:
                    b.end_load(t)
                    taken.append(t)
                except RuntimeError as e:
                    if "unknown handle" not in str(e):
                        raise
            mine = hid in shared.handles and not shared.handles[hid].done
            a.end_load(hid)
            return not taken and mine, f"{len(tries)} ids tried, taken {taken}, A's load still pinned: {mine}"
        finally:
            a.close()
            b.close()
            server.close()

    try:
        run("socket folder made first by nobody", made_by_nobody, needs_root=True)
        run("socket folder a symbolic link", symlinked)
        run("socket folder of ours, mode 0755", loose)
        run("a client of another uid (SO_PEERCRED)", client_of_nobody, needs_root=True)
        run("a socket of another uid at the store's name", server_of_nobody, needs_root=True)
        run("another connection's handle id", lambda d, n: handles(d, n, guess=False))
        run("guessed handle ids 1-8", lambda d, n: handles(d, n, guess=True))
    finally:
        store.close()
    tried = [c for c in cases if c["refused"] is not None]
    return {"trust_hijacks_tried": len(tried), "trust_hijacks_refused": sum(1 for c in tried if c["refused"]),
            "trust_hijacks_accepted": sum(1 for c in tried if not c["refused"]),
            "trust_hijacks_skipped": [f"{c['case']}: {c['how']}" for c in cases if c["refused"] is None],
            "trust_hijack_cases": cases}


def _ping(path: str) -> int:
    """As another uid: 0 closed unanswered (refused), 1 answered, 2 could not connect."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(path)
    except OSError:
        return 2
    body = b'{"op":"ping"}'
    try:
        s.sendall(struct.pack("<I", len(body)) + body)
        return 0 if s.recv(100) == b"" else 1
    except ConnectionError:
        return 0


def _evil_server(pub: str, ready_fd: int) -> int:
    """As nobody: a socket that answers like a store would (ok to anything)."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(pub, "evil.sock"))
    s.listen()
    os.write(ready_fd, b"1")
    s.settimeout(10)
    try:
        conn, _ = s.accept()
    except socket.timeout:
        return 0  # the client refused before connecting
    conn.settimeout(5)
    body = b'{"ok":true,"result":"pong"}'
    with contextlib.suppress(OSError):
        conn.sendall(struct.pack("<I", len(body)) + body)
        conn.recv(100)
    return 0


# -- bad settings ----------------------------------------------------------------------------------------
TTL_ZERO = [("dram", "ttl_s"), ("dram", "ttl_shared_s"), ("nvme", "ttl_s"), ("nvme", "ttl_shared_s"),
            ("remote", "ttl_s")]
BAD_URLS = ["redis://h:0", "redis://h:65536", "redis://h:abc", "redis://h:-1", "redis://h/x", "redis://h/-1",
            "redis://h:6379/0/1", "redis://h:6379/0?db=2"]


def bad_settings(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    cases: list[dict] = []

    def expect(case: str, key: str, fn) -> None:
        try:
            got = fn()
        except ConfigError as e:
            cases.append({"case": case, "key": key, "ok": e.key == key and f"'{key}'" in str(e),
                          "error": str(e)[:240]})
            return
        except Exception as e:
            cases.append({"case": case, "key": key, "ok": False, "error": f"UNEXPECTED {type(e).__name__}: {e}"[:240]})
            return
        if hasattr(got, "close"):
            got.close()
        cases.append({"case": case, "key": key, "ok": None, "error": "accepted"})

    expect("DRAM above this machine's memory", "tiers.dram.capacity_gb",
           lambda: _tiny_store(dram={"capacity_gb": 100000, "pin_memory": False}))
    for tier, field in TTL_ZERO:
        expect(f"{tier} {field} 0", f"tiers.{tier}.{field}", lambda t=tier, f=field: from_dict(
            {"tiers": {t: {f: 0, **({"url": "redis://h:6379"} if t == "remote" else {})}}}))
    for url in BAD_URLS:
        expect(f"redis url {url}", "tiers.remote.url", lambda u=url: from_dict({"tiers": {"remote": {"url": u}}}))
    expect("redis cluster url with a db", "tiers.remote.url",
           lambda: from_dict({"tiers": {"remote": {"url": ["redis://a:1/2"], "cluster": True}}}))
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen(1)
        port = held.getsockname()[1]
        expect("metrics port held by another program", "metrics.port", lambda: KVStore(
            from_dict({"tiers": {"dram": {"capacity_gb": 0.001, "pin_memory": False}, "nvme": {"capacity_gb": 0}},
                       "metrics": {"port": port}}), block_bytes=BB, fingerprint=FP))
    for v in (5, ["a.yaml"], b"c.yaml", {"path": "x"}):
        expect(f"config override {v!r}", "config", lambda v=v: load_config(overrides={"config": v}, environ={}))
    for i, data in enumerate((b"\xff\xfe\x00\x01 binary", b"\x00\x01\x02", bytes(range(256)))):
        (folder / f"binary{i}.yaml").write_bytes(data)
        expect(f"binary YAML file {i}", "config", lambda p=folder / f"binary{i}.yaml": load_config(p, environ={}))
    for key, data in (("tiers.nvme.path", {"tiers": {"nvme": {"path": str(folder / "a\x00b")}}}),
                      ("trace_path", {"trace_path": "/tmp/t\x00.jsonl"}),
                      ("tiers.remote.url", {"tiers": {"remote": {"url": "redis://127.0.0.1:6379/\x00"}}})):
        expect(f"NUL byte in {key}", key, lambda d=data: from_dict(d))
    for mode in (0o770, 0o720, 0o777):
        d = folder / f"nvme-{mode:o}"
        d.mkdir(exist_ok=True)
        os.chmod(d, mode)
        expect(f"NVMe folder mode {mode:04o}", "tiers.nvme.path", lambda d=d: open_store(d, block_bytes=BB))
    remote = {"remote": {"url": "redis://127.0.0.1:1", "timeout_ms": 50}}
    for var, values in (("KVSTORE_REMOTE_SECRET", {"KVSTORE_REMOTE_SECRET": "short"}),
                        ("KVSTORE_REMOTE_SECRET_PREVIOUS", {"KVSTORE_REMOTE_SECRET_PREVIOUS": "p" * 40})):
        def open_with(values=values):
            with env(**{"KVSTORE_REMOTE_SECRET": None, "KVSTORE_REMOTE_SECRET_PREVIOUS": None}), env(**values):
                return _tiny_store(**remote)
        expect(f"{var} unsound", var, open_with)
    expect("a secret in the config file", "tiers.remote.secret",
           lambda: from_dict({"tiers": {"remote": {"url": "redis://h:1", "secret": "s" * 40}}}))
    cases.append(_kvstore_config(folder))
    return {"trust_bad_settings_tried": len(cases),
            "trust_bad_settings_refused": sum(1 for c in cases if c["ok"]),
            "trust_bad_settings_accepted": sum(1 for c in cases if c["ok"] is None),
            "trust_bad_settings_unclear": sum(1 for c in cases if c["ok"] is False),
            "trust_bad_settings_failed": [c for c in cases if not c["ok"]], "trust_bad_setting_cases": cases}


def _kvstore_config(folder: Path) -> dict:
    """``kvstore config FILE`` with three bad keys: exit 2, one line naming each, no traceback."""
    f = folder / "three.yaml"
    f.write_text("tiers:\n  dram: {capacity_gb: 100000, ttl_s: 0}\n  remote: {url: 'redis://127.0.0.1:99999/0'}\n")
    keys = ["tiers.dram.capacity_gb", "tiers.dram.ttl_s", "tiers.remote.url"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE")}
    r = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "config", str(f)], capture_output=True, text=True,
                       env=clean, timeout=120, cwd=REPO)
    named = sorted(x.split("'")[1] for x in r.stderr.splitlines() if x.count("'") >= 2)
    ok = r.returncode == 2 and named == keys and "Traceback" not in r.stderr
    return {"case": "kvstore config: every bad key", "key": ", ".join(keys),
            "ok": ok if r.returncode != 0 else None, "error": f"exit {r.returncode}: {r.stderr.strip()[:240]}"}
