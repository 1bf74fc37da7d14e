"""``kvstore inspect``: what an NVMe folder or the shared Redis tier holds, read-only.

A folder (:func:`inspect_folder`) is read from its block files' headers only. Redis
(:func:`inspect_remote`) is SCANned for the tier's key names (``kvs:{<namespace hex>.<key[0] hex>}:<key hex>``,
see :mod:`kvstore.tiers.redis.client`); for each name one pipeline (per 512 names) reads only the
value's header (``GETRANGE name 0 HEADER_CORE-1``), its length (``STRLEN``) and its TTL left
(``PTTL``). No payload is read, nothing is written, and no TTL is refreshed (never GETEX); each
pipeline first sends ``CLIENT NO-TOUCH ON`` (Redis >= 7.2, Valkey) so that the reads leave the
values' LRU/LFU standing alone as well (an older server refuses it, which is ignored).

A value counts as a block when its header passes the checks a reader can make without the
payload: the header checksum, magic and version, the namespace and key it names equal to those in
the key name, and a payload length equal to the value's length minus the header. The payload
checksum is not verified (that would read the payload). Anything else under a well-formed name is
a bad value (a reader would count it a miss and delete it); names under ``kvs:{`` that are not the
tier's are counted as other keys and not read.

Credentials come from ``KVSTORE_REDIS_USERNAME`` / ``KVSTORE_REDIS_PASSWORD`` only; a url that
carries them is refused, and no message shows the password.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError, ResponseError
from redis.retry import Retry

from kvstore.ops.errors import FAILED, CommandError
from kvstore.ops.printable import printable
from kvstore.tiers import fileformat as ff
from kvstore.codecs.registry import CODEC_NAMES
from kvstore.tiers.nvme.folder import read_header
from kvstore.tiers.redis.value import MAC_BYTES

ENV_USER, ENV_PASSWORD = "KVSTORE_REDIS_USERNAME", "KVSTORE_REDIS_PASSWORD"

AGE_BUCKETS = ((60, "<1m"), (600, "1m-10m"), (3600, "10m-1h"), (86400, "1h-1d"), (7 * 86400, "1d-7d"),
               (float("inf"), ">7d"))


def new_namespace(**extra) -> dict:
    return {"blocks": 0, "bytes": 0, "payload_bytes": 0, "codecs": {}, "age": {name: 0 for _, name in AGE_BUCKETS},
            "oldest_s": None, "newest_s": None, **extra}


def count_block(info: dict, nbytes: int, payload_len: int, codec_id: int, age: float) -> None:
    """One good block of ``nbytes`` (its payload, codec and age in seconds) into ``info``."""
    info["blocks"] += 1
    info["bytes"] += nbytes
    info["payload_bytes"] += payload_len
    codec = CODEC_NAMES.get(codec_id, str(codec_id))
    info["codecs"][codec] = info["codecs"].get(codec, 0) + 1
    age = max(0.0, age)
    info["age"][next(label for limit, label in AGE_BUCKETS if age < limit)] += 1
    info["oldest_s"] = age if info["oldest_s"] is None else max(info["oldest_s"], age)
    info["newest_s"] = age if info["newest_s"] is None else min(info["newest_s"], age)


def namespace_lines(name: str, ns: dict, age_what: str) -> list[str]:
    return [f"  {name}: {ns['blocks']} blocks, {ns['bytes'] / 2**20:.1f} MiB "
            f"(payload {ns['payload_bytes'] / 2**20:.1f} MiB), codecs {ns['codecs'] or '{}'}",
            f"    age (since {age_what}): " + "  ".join(f"{k} {v}" for k, v in ns["age"].items())]



def inspect_folder(path: str, now: float | None = None) -> dict:
    """Summarize every ``kvstore-<namespace>`` folder under ``path`` (no payload is read)."""
    now = time.time() if now is None else now
    out: dict = {"path": os.path.abspath(path), "namespaces": {}, "blocks": 0, "bytes": 0, "bad_files": 0,
                 "temp_files": 0}
    if not os.path.isdir(path):
        raise CommandError(f"{path}: {'not a folder' if os.path.exists(path) else 'no such folder'} (give the "
                           "folder named in tiers.nvme.path, or a redis:// url)")
    spaces = sorted((d for d in os.scandir(path) if d.name.startswith("kvstore-") and d.is_dir(follow_symlinks=False)),
                    key=lambda d: d.name)
    if not spaces:
        raise CommandError(f"{path} is not a kvstore NVMe tier: it holds no kvstore-<namespace> folder (the store "
                           "makes one under tiers.nvme.path when it starts)")
    for ns in spaces:
        info = new_namespace(fingerprints={}, bad_files=0, temp_files=0)
        for root, dirs, files in os.walk(ns.path, followlinks=False):
            in_tmp = os.path.basename(root) == "tmp"
            for name in files:
                p = os.path.join(root, name)
                if root == ns.path and name.startswith("."):  # the tier's own (a shared folder's sweeper lease)
                    continue
                if in_tmp:
                    info["temp_files"] += 1
                    continue
                if not name.endswith(ff.SUFFIX) or os.path.islink(p):
                    info["bad_files"] += 1
                    continue
                try:
                    st = os.lstat(p)
                    h = read_header(p)
                except (OSError, ff.BadBlockFile):
                    info["bad_files"] += 1
                    continue
                count_block(info, st.st_size, h.payload_len, h.codec_id, now - st.st_mtime)
                fp = h.fingerprint.hex()
                info["fingerprints"][fp] = info["fingerprints"].get(fp, 0) + 1
        out["namespaces"][ns.name] = info
        for k in ("blocks", "bytes", "bad_files", "temp_files"):
            out[k] += info[k]
    return out


def render_folder(info: dict) -> str:
    lines = [f"{info['path']}: {info['blocks']} blocks, {info['bytes'] / 2**20:.1f} MiB, "
             f"{len(info['namespaces'])} namespace(s), {info['bad_files']} bad file(s), "
             f"{info['temp_files']} temp file(s)"]
    for name, ns in info["namespaces"].items():
        head, ages = namespace_lines(name, ns, "last use")
        lines.append(head)
        for fp, n in ns["fingerprints"].items():
            lines.append(f"    fingerprint {fp}: {n} blocks")
        lines.append(ages)
    return "\n".join(lines)
_NAME = re.compile(rb"kvs:\{([0-9a-f]{32})\.([0-9a-f]{2})\}:([0-9a-f]{32})")
_BATCH = 512  # names per pipeline
FOOTNOTE = ("namespaces are digests (model fingerprint + the remote tier's codec) and cannot be mapped back to "
            "a model here; a running store's kvstore_store_info metric names its model and namespace (the same "
            "digest when tiers.remote.codec equals tiers.nvme.codec)")


def _seed(url: str) -> tuple[str, int, int, bool, str]:
    """host, port, db, tls, and the url as messages show it (never with credentials)."""
    try:
        u = urlsplit(url)
        port = u.port or 6379
    except ValueError:
        raise CommandError("a remote url must look like redis://host:port[/db] (or rediss://)") \
            from None
    if u.scheme not in ("redis", "rediss") or not u.hostname:
        raise CommandError(f"a remote url must look like redis://host:port[/db] (or rediss://), "
                         f"got {u.scheme}://...")
    shown = f"{u.scheme}://{u.hostname}:{port}{u.path if u.path not in ('', '/') else ''}"
    if u.username or u.password:
        raise CommandError(f"the url {shown} carries credentials; refused: put them in "
                         f"{ENV_PASSWORD} (and {ENV_USER} for an ACL user) instead")
    try:
        db = int(u.path.strip("/") or 0)
    except ValueError:
        raise CommandError(f"{shown}: the path must be a database number") from None
    return u.hostname, port, db, u.scheme == "rediss", shown


def _new_ns() -> dict:
    return new_namespace(ttl_s=None, no_ttl=0, bad_values=0, bad_bytes=0, bad_reasons={}, _ttls=[])


def _check(value, length: int, ns: bytes, key: bytes) -> tuple[str | None, ff.Header | None]:
    """Why a value (its first HEADER_CORE bytes, and its length) is bad, or (None, header)."""
    if isinstance(value, ResponseError):
        return ("wrongtype" if "WRONGTYPE" in str(value) else "error"), None
    if not isinstance(value, bytes) or len(value) < ff.HEADER_CORE or length < ff.HEADER_CORE:
        return "truncated", None
    try:
        h = ff.unpack_header(value)
    except ff.BadBlockFile as e:
        return e.reason, None
    if h.fingerprint != ns or h.key != key:
        return "foreign", None
    if h.codec_id not in CODEC_NAMES:
        return "codec", None
    if h.payload_len != length - ff.HEADER_CORE - (MAC_BYTES if h.flags & ff.FLAG_MAC else 0):
        return "length", None
    return None, h


class _Clients:
    """One plain client per master (a cluster's from its slots map), built from the seeds."""

    def __init__(self, seeds: list, cluster: bool, username: str | None, password: str | None, timeout_s: float):
        self.cluster = cluster
        if cluster and any(s[2] for s in seeds):
            raise CommandError("a cluster has only database 0; drop the /db from the url")
        # a brief retry of a network blip; refused credentials are not retried (they fail the first PING)
        kw = dict(username=username, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                  retry=Retry(ExponentialBackoff(cap=1.0, base=0.1), 2))
        once = {**kw, "retry": Retry(ExponentialBackoff(), 0)}
        for i, (host, port, db, tls, _) in enumerate(seeds):  # the first seed that answers (a clear auth error)
            try:
                with redis.Redis(host=host, port=port, db=db, ssl=tls, **once) as c:
                    c.ping()
                break
            except AuthenticationError:
                raise
            except (RedisError, OSError):
                if i == len(seeds) - 1:
                    raise
        self._top = None
        if cluster:
            self._top = redis.RedisCluster(startup_nodes=[ClusterNode(s[0], s[1]) for s in seeds], ssl=seeds[0][3],
                                           **kw)
            self.nodes = [self._top.get_redis_connection(n)
                          for n in sorted(self._top.get_primaries(), key=lambda n: n.name)]
        else:
            host, port, db, tls, _ = seeds[0]
            self.nodes = [redis.Redis(host=host, port=port, db=db, ssl=tls, **kw)]

    def close(self) -> None:
        for c in [self._top] if self._top is not None else self.nodes:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a half-built client
                pass


def inspect_remote(url: str | list[str], *, cluster: bool = False, limit: int | None = None,
                   username: str | None = None, password: str | None = None, now: float | None = None,
                   timeout_s: float = 10.0) -> dict:
    """Summarize the remote tier at ``url`` (for a cluster: one or more seeds, a list or comma-joined)
    per namespace, from value headers only. ``username`` / ``password`` default to the environment."""
    urls = [u.strip() for u in (url.split(",") if isinstance(url, str) else url) if u.strip()]
    if not urls:
        raise CommandError("no remote url given")
    if len(urls) > 1 and not cluster:
        raise CommandError("several urls are cluster seeds: add --cluster")
    if limit is not None and limit < 1:
        raise CommandError(f"--limit must be at least 1, got {limit}")
    seeds = [_seed(u) for u in urls]
    if username is None:
        username = os.environ.get(ENV_USER) or None
    if password is None:
        password = os.environ.get(ENV_PASSWORD) or None
    shown = ",".join(s[4] for s in seeds)
    now = time.time() if now is None else now

    def fail(e: Exception) -> CommandError:
        msg = str(e)
        if password:
            msg = msg.replace(password, "***")
        if isinstance(e, AuthenticationError) or "NOAUTH" in msg or "WRONGPASS" in msg or "invalid password" in msg:
            what = ("requires a password and none was given" if password is None
                    else "refused the username/password given")
            return CommandError(f"{shown} {what}; set {ENV_PASSWORD} (and {ENV_USER} for an ACL user) in the "
                                "environment", FAILED)
        # the server wrote msg: one line, escaped (kvstore.ops.printable), never its whole answer
        return CommandError(f"{shown} failed: {type(e).__name__}: {printable(msg, 300)}", FAILED)

    out: dict = {"url": shown, "cluster": cluster, "servers": 0, "namespaces": {}, "blocks": 0, "bytes": 0,
                 "bad_values": 0, "other_keys": 0, "values_read": 0, "limit": limit, "limit_reached": False}
    namespaces: dict[str, dict] = {}
    left = float("inf") if limit is None else limit
    clients = None
    try:
        clients = _Clients(seeds, cluster, username, password, timeout_s)
        out["servers"] = len(clients.nodes)
        for node in clients.nodes:
            names = node.scan_iter(match=b"kvs:{*", count=1000)
            while True:
                batch = []
                for name in names:
                    m = _NAME.fullmatch(name)
                    if m is None or int(m[2], 16) != int(m[3][:2], 16):
                        out["other_keys"] += 1
                        continue
                    batch.append((name, m))
                    if len(batch) >= min(_BATCH, left):
                        break
                if not batch:
                    break
                pipe = node.pipeline(transaction=False)
                pipe.execute_command("CLIENT", "NO-TOUCH", "ON")  # refused before Redis 7.2: ignored
                for name, _ in batch:
                    pipe.getrange(name, 0, ff.HEADER_CORE - 1)
                    pipe.strlen(name)
                    pipe.pttl(name)
                res = pipe.execute(raise_on_error=False)[1:]
                for i, (name, m) in enumerate(batch):
                    value, length, pttl = res[3 * i: 3 * i + 3]
                    if pttl == -2 or length == 0:
                        continue  # gone since the SCAN
                    for r in (length, pttl):
                        if isinstance(r, Exception) and not isinstance(r, ResponseError):
                            raise r
                    if isinstance(value, Exception) and not isinstance(value, ResponseError):
                        raise value
                    if left <= 0:
                        break
                    left -= 1
                    out["values_read"] += 1
                    ns_hex = m[1].decode()
                    info = namespaces.setdefault(ns_hex, _new_ns())
                    size = length if isinstance(length, int) else 0
                    reason, h = _check(value, size, bytes.fromhex(ns_hex), bytes.fromhex(m[3].decode()))
                    if reason is not None:
                        info["bad_values"] += 1
                        info["bad_bytes"] += size
                        info["bad_reasons"][reason] = info["bad_reasons"].get(reason, 0) + 1
                        continue
                    count_block(info, size, h.payload_len, h.codec_id, now - h.created)
                    if isinstance(pttl, int) and pttl >= 0:
                        info["_ttls"].append(pttl / 1000)
                    else:
                        info["no_ttl"] += 1
                if left <= 0:
                    out["limit_reached"] = True
                    break
            if out["limit_reached"]:
                break
    except (RedisError, RedisClusterException, OSError) as e:
        raise fail(e) from None
    finally:
        if clients is not None:
            clients.close()
    for ns_hex in sorted(namespaces):
        info = namespaces[ns_hex]
        ttls = sorted(info.pop("_ttls"))
        if ttls:
            info["ttl_s"] = {"min": ttls[0], "median": statistics.median(ttls), "max": ttls[-1]}
        out["namespaces"][ns_hex] = info
        for k in ("blocks", "bytes", "bad_values"):
            out[k] += info[k]
    out["note"] = FOOTNOTE
    return out


def _dur(s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.1f}s"


def render(info: dict) -> str:
    kind = f"cluster of {info['servers']} master(s)" if info["cluster"] else "server"
    lines = [f"{info['url']} ({kind}): {info['blocks']} blocks, {info['bytes'] / 2**20:.1f} MiB, "
             f"{len(info['namespaces'])} namespace(s), {info['bad_values']} bad value(s), "
             f"{info['other_keys']} other key(s)"]
    for name, ns in info["namespaces"].items():
        lines += namespace_lines(name, ns, "written")
        t = ns["ttl_s"]
        ttl = "none" if t is None else f"min {_dur(t['min'])}  median {_dur(t['median'])}  max {_dur(t['max'])}"
        if t is not None and ns["no_ttl"]:
            ttl += f"  ({ns['no_ttl']} without a TTL)"
        lines.append(f"    ttl remaining: {ttl}")
        if ns["bad_values"]:
            why = ", ".join(f"{k} {v}" for k, v in sorted(ns["bad_reasons"].items()))
            lines.append(f"    bad values: {ns['bad_values']} ({why})")
    if info["limit_reached"]:
        lines.append(f"  stopped after --limit {info['limit']} values: the counts may be partial")
    lines.append(f"  note: {info['note']}")
    return "\n".join(lines)
