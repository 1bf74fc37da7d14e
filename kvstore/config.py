"""The one typed, validated config object, built from YAML + inline + environment overrides.

Schema (public; the tuner writes it, the connector reads it)::

    tiers:
      dram: {capacity_gb, ttl_s, ttl_shared_s, policy, codec, pin_memory, headroom_blocks}
      nvme: {path, capacity_gb, ttl_s, ttl_shared_s, policy, codec, zstd_level, o_direct, write_mode, io_threads, header, admit_after}
      remote: {url, cluster, ttl_s, codec, zstd_level, write_mode, timeout_ms, io_threads}
    io: {async_saves, async_loads}
    metrics: {port}
    trace_path: null
    trace_tokens: false

Sizes are GiB (2**30 bytes). ``ttl_s`` is an idle time: an entry expires ``ttl_s`` seconds
after it was last stored or hit (null = never). ``ttl_shared_s`` is the idle TTL of a block hit by
two or more distinct sessions (a TTL class for system prompts, tool schemas; null = ``ttl_s``). Unknown keys and bad values raise
:class:`ConfigError`, which names the key, the value and what is allowed.

Precedence, lowest first: built-in defaults < YAML file < ``KVSTORE__A__B=value`` environment
variables < inline overrides (a nested dict, e.g. vLLM's ``kv_connector_extra_config``).
``KVSTORE_CONFIG`` names the file when no path is given.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

GiB = 1 << 30

CODECS = ("none", "int8", "fp8", "zstd", "int8+zstd", "fp8+zstd")
O_DIRECT_CHOICES = ("auto", True, False)
WRITE_MODES = ("write_back", "write_through")
PIN_CHOICES = ("auto", True, False)
REMOTE_WRITE_MODES = ("write_through",)  # write-back to a shared tier: not built (see RemoteConfig)
HEADER_CHOICES = ("auto", "xattr", "inline")


class ConfigError(ValueError):
    """A config value or key is invalid. The message names key, value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config key '{key}': invalid value {value!r}; allowed: {allowed}")


def _policy_names() -> tuple[str, ...]:
    from kvstore.policy import POLICIES

    return tuple(sorted(POLICIES))


# -- field validators --------------------------------------------------------------------------


def _number(key: str, v: Any, *, minimum: float = 0.0, allow_none: bool = False) -> float | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < minimum:
        allowed = f"a finite number >= {minimum:g}" + (" or null" if allow_none else "")
        raise ConfigError(key, v, allowed)
    return float(v)


def _int(key: str, v: Any, *, minimum: int, maximum: int | None = None, allow_none: bool = False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or (maximum is not None and v > maximum):
        rng = f"an integer in [{minimum}, {maximum}]" if maximum is not None else f"an integer >= {minimum}"
        raise ConfigError(key, v, rng + (" or null" if allow_none else ""))
    return v


def _auto_or_int(key: str, v: Any) -> int | str:
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(key, v, "auto | an integer >= 0")
    return v


def _choice(key: str, v: Any, choices: tuple) -> Any:
    if isinstance(v, str):
        low = v.strip().lower()
        if low in ("true", "false") and (True in choices):
            v = low == "true"
        else:
            v = low
    for c in choices:
        if v == c and type(v) is type(c):
            return c
    raise ConfigError(key, v, " | ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices))


# -- the config objects -----------------------------------------------------------------------


@dataclass(frozen=True)
class DramConfig:
    capacity_gb: float = 4.0
    ttl_s: float | None = 3600.0
    ttl_shared_s: float | None = None  # TTL of blocks hit by >= 2 distinct sessions; None = ttl_s
    policy: str = "lru"
    codec: str = "none"
    pin_memory: Any = "auto"  # auto: pin through torch when CUDA is available
    headroom_blocks: Any = "auto"  # slots held back for victims being demoted; auto: 1/8 of them

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GiB)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0


@dataclass(frozen=True)
class NvmeConfig:
    path: str | None = None  # null: a private temporary folder, removed at close
    capacity_gb: float = 100.0
    ttl_s: float | None = 86400.0
    ttl_shared_s: float | None = None  # TTL of blocks hit by >= 2 distinct sessions; None = ttl_s
    policy: str = "lru"
    codec: str = "none"
    zstd_level: int = 3  # for the +zstd codecs (1 fast .. 19 small)
    o_direct: Any = "auto"
    write_mode: str = "write_back"
    io_threads: int = 4
    header: str = "auto"  # auto | xattr | inline: where a block file keeps its header
    admit_after: int = 0  # write a block to NVMe once this many requests used it (0, 1: all); placement.Admission

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GiB)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0


@dataclass(frozen=True)
class RemoteConfig:
    """A tier shared by every engine, on Redis or Valkey (issue 14); off while ``url`` is null.

    ``url``: ``redis://host:port[/db]`` or ``rediss://`` (TLS); with ``cluster: true`` one url or
    a list of seed nodes. Credentials only from the environment (``KVSTORE_REDIS_USERNAME``,
    ``KVSTORE_REDIS_PASSWORD``), never here. ``ttl_s``: idle TTL (SET EX, refreshed by GETEX on a
    hit), so Redis's ``volatile-lru`` can evict under ``maxmemory``. ``write_mode``:
    write-through only (sharing needs a block there before DRAM evicts it). ``timeout_ms``: a
    slower answer is a miss."""

    url: Any = None
    cluster: bool = False
    ttl_s: float | None = 86400.0
    codec: str = "none"
    zstd_level: int = 3
    write_mode: str = "write_through"
    timeout_ms: int = 200
    io_threads: int = 4

    @property
    def enabled(self) -> bool:
        return self.url is not None


@dataclass(frozen=True)
class TiersConfig:
    dram: DramConfig = field(default_factory=DramConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)


@dataclass(frozen=True)
class IoConfig:
    """Where the connector moves bytes (issue 13). ``async_saves``: ``wait_for_save`` only enqueues;
    the gather runs on a copy worker and the engine's blocks stay allocated until it completes.
    ``async_loads``: a hit with blocks below DRAM loads while the request waits
    (``WAITING_FOR_REMOTE_KVS``) and other requests run; ``false`` loads everything inline
    before the forward pass (the first design, kept to measure against)."""

    async_saves: bool = True
    async_loads: bool = True


@dataclass(frozen=True)
class MetricsConfig:
    port: int | None = None


@dataclass(frozen=True)
class StoreConfig:
    tiers: TiersConfig = field(default_factory=TiersConfig)
    io: IoConfig = field(default_factory=IoConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    trace_path: str | None = None
    trace_tokens: bool = False  # the trace keeps each prompt's token ids (opt-in: prompts can be private)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# -- building from plain data -----------------------------------------------------------------


def _check_keys(prefix: str, data: Mapping, cls) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(prefix or "<root>", data, "a mapping")
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in names:
            key = f"{prefix}.{k}" if prefix else str(k)
            raise ConfigError(key, data[k], f"known keys here are {', '.join(names)} (unknown key)")


def _dram(d: Mapping) -> DramConfig:
    p = "tiers.dram"
    _check_keys(p, d, DramConfig)
    base = DramConfig()
    return DramConfig(
        capacity_gb=_number(f"{p}.capacity_gb", d.get("capacity_gb", base.capacity_gb)),
        ttl_s=_number(f"{p}.ttl_s", d.get("ttl_s", base.ttl_s), allow_none=True),
        ttl_shared_s=_number(f"{p}.ttl_shared_s", d.get("ttl_shared_s", base.ttl_shared_s), allow_none=True),
        policy=_choice(f"{p}.policy", d.get("policy", base.policy), _policy_names()),
        codec=_choice(f"{p}.codec", d.get("codec", base.codec), CODECS),
        pin_memory=_choice(f"{p}.pin_memory", d.get("pin_memory", base.pin_memory), PIN_CHOICES),
        headroom_blocks=_auto_or_int(f"{p}.headroom_blocks", d.get("headroom_blocks", base.headroom_blocks)),
    )


def _nvme(d: Mapping) -> NvmeConfig:
    p = "tiers.nvme"
    _check_keys(p, d, NvmeConfig)
    base = NvmeConfig()
    path = d.get("path", base.path)
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise ConfigError(f"{p}.path", path, "a folder path (string) or null")
    return NvmeConfig(
        path=os.path.expanduser(path) if path else None,
        capacity_gb=_number(f"{p}.capacity_gb", d.get("capacity_gb", base.capacity_gb)),
        ttl_s=_number(f"{p}.ttl_s", d.get("ttl_s", base.ttl_s), allow_none=True),
        ttl_shared_s=_number(f"{p}.ttl_shared_s", d.get("ttl_shared_s", base.ttl_shared_s), allow_none=True),
        policy=_choice(f"{p}.policy", d.get("policy", base.policy), _policy_names()),
        codec=_choice(f"{p}.codec", d.get("codec", base.codec), CODECS),
        zstd_level=_int(f"{p}.zstd_level", d.get("zstd_level", base.zstd_level), minimum=1, maximum=19),
        o_direct=_choice(f"{p}.o_direct", d.get("o_direct", base.o_direct), O_DIRECT_CHOICES),
        write_mode=_choice(f"{p}.write_mode", d.get("write_mode", base.write_mode), WRITE_MODES),
        io_threads=_int(f"{p}.io_threads", d.get("io_threads", base.io_threads), minimum=1, maximum=64),
        header=_choice(f"{p}.header", d.get("header", base.header), HEADER_CHOICES),
        admit_after=_int(f"{p}.admit_after", d.get("admit_after", base.admit_after), minimum=0),
    )


def _remote_url(key: str, v: Any, cluster: bool):
    urls = v if isinstance(v, list) else [v]
    if v is None:
        return None
    if not urls or (isinstance(v, list) and not cluster and len(urls) != 1):
        raise ConfigError(key, v, "one redis:// or rediss:// url (a list of seed nodes only with cluster: true)")
    for u in urls:
        if isinstance(u, str) and "@" in u:
            raise ConfigError(key, "<a url with credentials>", "a url without credentials: they come from the "
                              "environment only (KVSTORE_REDIS_USERNAME, KVSTORE_REDIS_PASSWORD)")
        if not isinstance(u, str) or not u.startswith(("redis://", "rediss://")) or len(u) <= len("rediss://"):
            raise ConfigError(key, u,
                              "redis://host:port[/db] or rediss://host:port[/db] (a list with cluster: true), or null")
    return list(urls) if isinstance(v, list) else v


def _remote(d: Mapping) -> RemoteConfig:
    p = "tiers.remote"
    if isinstance(d, Mapping):
        for k in d:
            if isinstance(k, str) and any(w in k.lower() for w in ("pass", "user", "auth", "token", "secret")):
                raise ConfigError(f"{p}.{k}", "<not shown>", "no credentials in the config: set "
                                  "KVSTORE_REDIS_USERNAME / KVSTORE_REDIS_PASSWORD in the environment")
    _check_keys(p, d, RemoteConfig)
    base = RemoteConfig()
    cluster = _choice(f"{p}.cluster", d.get("cluster", base.cluster), (True, False))
    return RemoteConfig(
        url=_remote_url(f"{p}.url", d.get("url", base.url), cluster),
        cluster=cluster,
        ttl_s=_number(f"{p}.ttl_s", d.get("ttl_s", base.ttl_s), allow_none=True),
        codec=_choice(f"{p}.codec", d.get("codec", base.codec), CODECS),
        zstd_level=_int(f"{p}.zstd_level", d.get("zstd_level", base.zstd_level), minimum=1, maximum=19),
        write_mode=_choice(f"{p}.write_mode", d.get("write_mode", base.write_mode), REMOTE_WRITE_MODES),
        timeout_ms=_int(f"{p}.timeout_ms", d.get("timeout_ms", base.timeout_ms), minimum=1, maximum=60_000),
        io_threads=_int(f"{p}.io_threads", d.get("io_threads", base.io_threads), minimum=1, maximum=64),
    )


def _section(data: Mapping, name: str):
    """A nested section; null means empty (anything else that is not a mapping is refused later)."""
    v = data.get(name)
    return {} if v is None else v


def from_dict(data: Mapping | None) -> StoreConfig:
    """Build and validate a :class:`StoreConfig` from plain nested data (e.g. parsed YAML)."""
    data = {} if data is None else data
    _check_keys("", data, StoreConfig)
    tiers = _section(data, "tiers")
    _check_keys("tiers", tiers, TiersConfig)
    metrics = _section(data, "metrics")
    _check_keys("metrics", metrics, MetricsConfig)
    io = _section(data, "io")
    _check_keys("io", io, IoConfig)
    trace = data.get("trace_path")
    if trace is not None and (not isinstance(trace, str) or not trace.strip()):
        raise ConfigError("trace_path", trace, "a file path (string) or null")
    return StoreConfig(
        tiers=TiersConfig(dram=_dram(_section(tiers, "dram")), nvme=_nvme(_section(tiers, "nvme")),
                          remote=_remote(_section(tiers, "remote"))),
        io=IoConfig(async_saves=_choice("io.async_saves", io.get("async_saves", True), (True, False)),
                    async_loads=_choice("io.async_loads", io.get("async_loads", True), (True, False))),
        metrics=MetricsConfig(port=_int("metrics.port", metrics.get("port"), minimum=1, maximum=65535, allow_none=True)),
        trace_path=trace,
        trace_tokens=_choice("trace_tokens", data.get("trace_tokens", False), (True, False)),
    )


def merge(base: Mapping, override: Mapping) -> dict:
    """Deep-merge ``override`` into a copy of ``base`` (mappings merge, everything else replaces)."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


ENV_PREFIX = "KVSTORE__"


def env_overrides(environ: Mapping[str, str]) -> dict:
    """``KVSTORE__TIERS__DRAM__CAPACITY_GB=8`` -> ``{"tiers": {"dram": {"capacity_gb": 8}}}``.

    Values are parsed as YAML scalars, so ``null``, ``true`` and numbers work.
    """
    out: dict = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
        if not parts:
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        node = out
        for i, p in enumerate(parts[:-1]):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(parts[: i + 1]), node,
                                  f"a mapping (set both {name} and a scalar above it in the environment)")
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigError(".".join(parts), value, f"a mapping (set both {name} and keys below it in the environment)")
        node[parts[-1]] = value
    return out


def read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError("config", str(path), f"a readable YAML file ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("config", str(path), f"valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError("config", str(path), f"a YAML mapping at the top level, not a {type(data).__name__}")
    return data


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping | None = None,
    environ: Mapping[str, str] | None = None,
) -> StoreConfig:
    """Defaults < YAML file (``path`` or ``$KVSTORE_CONFIG``) < ``KVSTORE__*`` env < ``overrides``."""
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    if path is None:
        path = overrides.pop("config", None) or environ.get("KVSTORE_CONFIG") or None
    else:
        overrides.pop("config", None)
    data: dict = read_yaml(path) if path else {}
    data = merge(data, env_overrides(environ))
    data = merge(data, overrides)
    return from_dict(data)
