"""The one typed, validated config object, built from YAML + inline + environment overrides.

Schema (public; the tuner writes it, the connector reads it)::

    tiers:
      dram: {capacity_gb, ttl_s, ttl_shared_s, policy, codec, pin_memory, headroom_blocks}
      nvme: {path, capacity_gb, ttl_s, ttl_shared_s, policy, codec, zstd_level, o_direct, write_mode, io_threads, header, admit_after}
      remote: {url, cluster, ttl_s, codec, zstd_level, write_mode, timeout_ms, io_threads}
    io: {async_saves, async_loads, load_only_if_faster}
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
from typing import Any, Callable, Mapping

import yaml

GiB = 1 << 30

O_DIRECT_CHOICES = ("auto", True, False)
WRITE_MODES = ("write_back", "write_through")
PIN_CHOICES = ("auto", True, False)
REMOTE_WRITE_MODES = ("write_through",)  # write-back to a shared tier: not built (see RemoteConfig)
HEADER_CHOICES = ("auto", "xattr", "inline")
BOOL = (True, False)


class ConfigError(ValueError):
    """A config value or key is invalid. The message names key, value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config key '{key}': invalid value {value!r}; allowed: {allowed}")


def _policy_names() -> tuple[str, ...]:
    from kvstore.policy import POLICIES

    return tuple(sorted(POLICIES))


def _codec_names() -> tuple[str, ...]:
    from kvstore.codecs.registry import CODECS

    return tuple(CODECS)


# -- field validators: (key, value, **options) -> the value to keep, or ConfigError -------------


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


def _choice(key: str, v: Any, choices: tuple | Callable[[], tuple]) -> Any:
    choices = choices() if callable(choices) else choices
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


def _path(key: str, v: Any, *, what: str, expand: bool = False) -> str | None:
    if v is not None and (not isinstance(v, str) or not v.strip()):
        raise ConfigError(key, v, f"a {what} path (string) or null")
    return (os.path.expanduser(v) if expand else v) if v else None


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


def _f(default: Any, check: Callable, *, needs: tuple[str, ...] = (), **options) -> Any:
    """A config field: its default, and its validator (with options; ``needs``: fields of the
    same section it is checked against, passed by name). Adding a key is adding a line here."""
    return field(default=default, metadata={"check": check, "options": options, "needs": needs})


def _sec(cls) -> Any:
    """A nested section (a mapping; null = empty)."""
    return field(default_factory=cls, metadata={"section": cls})


# -- the config objects -----------------------------------------------------------------------


class _Sized:
    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GiB)  # type: ignore[attr-defined]

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0


_TTL = dict(allow_none=True)


@dataclass(frozen=True)
class DramConfig(_Sized):
    capacity_gb: float = _f(4.0, _number)
    ttl_s: float | None = _f(3600.0, _number, **_TTL)
    ttl_shared_s: float | None = _f(None, _number, **_TTL)  # TTL of blocks hit by >= 2 distinct sessions; None = ttl_s
    policy: str = _f("lru", _choice, choices=_policy_names)
    codec: str = _f("none", _choice, choices=_codec_names)
    pin_memory: Any = _f("auto", _choice, choices=PIN_CHOICES)  # auto: pin through torch when CUDA is available
    headroom_blocks: Any = _f("auto", _auto_or_int)  # slots held back for victims being demoted; auto: 1/8 of them


@dataclass(frozen=True)
class NvmeConfig(_Sized):
    path: str | None = _f(None, _path, what="folder", expand=True)  # null: a private temporary folder, removed at close
    capacity_gb: float = _f(100.0, _number)
    ttl_s: float | None = _f(86400.0, _number, **_TTL)
    ttl_shared_s: float | None = _f(None, _number, **_TTL)  # TTL of blocks hit by >= 2 distinct sessions; None = ttl_s
    policy: str = _f("lru", _choice, choices=_policy_names)
    codec: str = _f("none", _choice, choices=_codec_names)
    zstd_level: int = _f(3, _int, minimum=1, maximum=19)  # for the +zstd codecs (1 fast .. 19 small)
    o_direct: Any = _f("auto", _choice, choices=O_DIRECT_CHOICES)
    write_mode: str = _f("write_back", _choice, choices=WRITE_MODES)
    io_threads: int = _f(4, _int, minimum=1, maximum=64)
    header: str = _f("auto", _choice, choices=HEADER_CHOICES)  # auto | xattr | inline: where a block file keeps its header
    admit_after: int = _f(0, _int, minimum=0)  # write a block to NVMe once this many requests used it (0, 1: all); placement.Admission


@dataclass(frozen=True)
class RemoteConfig:
    """A tier shared by every engine, on Redis or Valkey (issue 14); off while ``url`` is null.

    ``url``: ``redis://host:port[/db]`` or ``rediss://`` (TLS; the server's certificate is checked
    against the system's trust store, or ``SSL_CERT_FILE``); with ``cluster: true`` one url or
    a list of seed nodes. Credentials only from the environment (``KVSTORE_REDIS_USERNAME``,
    ``KVSTORE_REDIS_PASSWORD``), never here. ``ttl_s``: idle TTL (SET EX, refreshed by GETEX on a
    hit), so Redis's ``volatile-lru`` can evict under ``maxmemory``. ``write_mode``:
    write-through only (sharing needs a block there before DRAM evicts it). ``timeout_ms``: a
    slower answer is a miss."""

    url: Any = _f(None, _remote_url, needs=("cluster",))
    cluster: bool = _f(False, _choice, choices=BOOL)
    ttl_s: float | None = _f(86400.0, _number, **_TTL)
    codec: str = _f("none", _choice, choices=_codec_names)
    zstd_level: int = _f(3, _int, minimum=1, maximum=19)
    write_mode: str = _f("write_through", _choice, choices=REMOTE_WRITE_MODES)
    timeout_ms: int = _f(200, _int, minimum=1, maximum=60_000)
    io_threads: int = _f(4, _int, minimum=1, maximum=64)

    @property
    def enabled(self) -> bool:
        return self.url is not None

    @staticmethod
    def _refuse(prefix: str, d: Any) -> None:
        """No credentials in a config file, under any key name."""
        for k in d if isinstance(d, Mapping) else ():
            if isinstance(k, str) and any(w in k.lower() for w in ("pass", "user", "auth", "token", "secret")):
                raise ConfigError(f"{prefix}.{k}", "<not shown>", "no credentials in the config: set "
                                  "KVSTORE_REDIS_USERNAME / KVSTORE_REDIS_PASSWORD in the environment")


@dataclass(frozen=True)
class TiersConfig:
    dram: DramConfig = _sec(DramConfig)
    nvme: NvmeConfig = _sec(NvmeConfig)
    remote: RemoteConfig = _sec(RemoteConfig)


@dataclass(frozen=True)
class IoConfig:
    """Where the connector moves bytes (issue 13). ``async_saves``: ``wait_for_save`` only enqueues;
    the gather runs on a copy worker and the engine's blocks stay allocated until it completes.
    ``async_loads``: a hit with blocks below DRAM loads while the request waits
    (``WAITING_FOR_REMOTE_KVS``) and other requests run; ``false`` loads everything inline
    before the forward pass (the first design, kept to measure against)."""

    async_saves: bool = _f(True, _choice, choices=BOOL)
    async_loads: bool = _f(True, _choice, choices=BOOL)
    # cut a hit where loading is slower than recomputing (placement.worth_loading; reason
    # slower_than_recompute), from each tier's measured reads and the engine's step cost fitted
    # over its timed forward passes (kvstore.stepcost). Measured on the tiny CPU test model (NVMe
    # only): a block costs 0.55 ms to load and 1.4 ms (first) to 25 ms (at 8k) to recompute
    load_only_if_faster: bool = _f(True, _choice, choices=BOOL)


@dataclass(frozen=True)
class MetricsConfig:
    port: int | None = _f(None, _int, minimum=1, maximum=65535, allow_none=True)


@dataclass(frozen=True)
class StoreConfig:
    tiers: TiersConfig = _sec(TiersConfig)
    io: IoConfig = _sec(IoConfig)
    metrics: MetricsConfig = _sec(MetricsConfig)
    trace_path: str | None = _f(None, _path, what="file")
    trace_tokens: bool = _f(False, _choice, choices=BOOL)  # the trace keeps each prompt's token ids (opt-in)

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


def _build(cls, prefix: str, data: Any):
    """A config object from plain data, every field checked by the validator its metadata names."""
    data = {} if data is None else data
    getattr(cls, "_refuse", lambda p, d: None)(prefix, data)
    _check_keys(prefix, data, cls)
    out: dict[str, Any] = {}
    for f in sorted(dataclasses.fields(cls), key=lambda f: bool(f.metadata.get("needs"))):  # stable
        key = f"{prefix}.{f.name}" if prefix else f.name
        if "section" in f.metadata:
            out[f.name] = _build(f.metadata["section"], key, data.get(f.name))
            continue
        opts = dict(f.metadata["options"], **{n: out[n] for n in f.metadata["needs"]})
        out[f.name] = f.metadata["check"](key, data.get(f.name, f.default), **opts)
    return cls(**out)


def from_dict(data: Mapping | None) -> StoreConfig:
    """Build and validate a :class:`StoreConfig` from plain nested data (e.g. parsed YAML)."""
    return _build(StoreConfig, "", data)


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
