"""The config's error and its field validators: ``(key, value, **options)`` -> the value to keep,
or a :class:`ConfigError` naming the key, the value, why and what is allowed. Pure: nothing here
looks at the machine (:mod:`kvstore.store.machine` does)."""

from __future__ import annotations

import difflib
import math
import os
import re
import reprlib
from dataclasses import field as _dc_field
from typing import Any, Callable
from urllib.parse import urlsplit

class _UnknownKey:
    """ConfigError's value for a key its section does not have (one object, also once pickled)."""

    def __reduce__(self):
        return "UNKNOWN_KEY"


UNKNOWN_KEY = _UnknownKey()
_SHOW = reprlib.Repr()  # a value in a message: a YAML alias bomb or a 1 MiB string is shown cut short
_SHOW.maxstring = _SHOW.maxother = 300
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict = 2, 6, 6


class ConfigError(ValueError):
    """A config value or key is invalid. The message names key, value, why (when the value alone
    does not say) and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str, why: str | None = None):
        self.key, self.value, self.allowed, self.why = key, value, allowed, why
        what = "unknown key" if value is UNKNOWN_KEY else f"invalid value {_SHOW.repr(value)}"
        super().__init__(f"config key '{key}': {what}" + (f" ({why})" if why else "") + f"; allowed: {allowed}")

    @classmethod
    def unknown(cls, key: str, known: list[str]) -> "ConfigError":
        """A key its section does not have (its value not shown: it may be a credential under a
        misspelt name), with the nearest known one."""
        name = key.rsplit(".", 1)[-1]
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        return cls(key, UNKNOWN_KEY, "known keys here are " + ", ".join(known),
                   f"did you mean '{near[0]}'?" if near else None)

    def __reduce__(self):  # pickles (e.g. across a process boundary) with its fields
        return ConfigError, (self.key, self.value, self.allowed, self.why)


# -- fields and sections: what a config dataclass (kvstore.config, a medium's spec) is made of -------

GiB = 1 << 30


def field(default: Any, check: Callable, *, needs: tuple[str, ...] = (), **options) -> Any:
    """A config field: its default, and its validator (with options; ``needs``: fields of the
    same section it is checked against, passed by name). Adding a key is adding a line."""
    return _dc_field(default=default, metadata={"check": check, "options": options, "needs": needs})


def section(cls) -> Any:
    """A nested section (a mapping; null = empty)."""
    return _dc_field(default_factory=cls, metadata={"section": cls})


class Sized:
    """A tier section sized by ``capacity_gb`` (0: the tier is off)."""

    @property
    def capacity_bytes(self) -> int:
        return int(self.capacity_gb * GiB)  # type: ignore[attr-defined]

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0


TTL = dict(null="for no expiry")
TTL_SHARED = dict(null="for the tier's ttl_s")
BOOL = (True, False)
# KV events (issue 32): vLLM's media names (vllm.distributed.kv_events: MEDIUM_GPU/CPU/STORAGE) and
# BlockStored/BlockRemoved's ``locality`` (vLLM 0.32 carries it: LOCAL or REMOTE to the publisher)
MEDIA = ("CPU", "STORAGE", "GPU")
LOCALITIES = ("LOCAL", "REMOTE")
NOT_ANNOUNCED = dict(null="the tier is not announced")
UNSPECIFIED = dict(null="unspecified")


def policy_names() -> tuple[str, ...]:
    from kvstore.tiers.policy import POLICIES

    return tuple(sorted(POLICIES))


def codec_names() -> tuple[str, ...]:
    from kvstore.codecs.registry import CODECS

    return tuple(CODECS)


def _real(v: Any, low: float, high: float) -> bool:
    """A real number (not a bool) in [low, high]; an int too large for a float (10**400) is out of
    range, not an OverflowError."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v) and low <= v <= high
    except OverflowError:
        return False


MAX_GB = 1e9  # 1 EiB: more is a typo, and GiB * 2**30 must stay an int a float can hold
MAX_TTL_S = 1e9  # ~31 years (null: none); Redis refuses a PX above ~9.2e18 ms, which put() would meet


def number(key: str, v: Any, *, minimum: float = 0.0, maximum: float = MAX_GB, allow_none: bool = False) -> float | None:
    if v is None and allow_none:
        return None
    if not _real(v, minimum, maximum):
        allowed = f"a finite number >= {minimum:g}, at most {maximum:g}" + (" or null" if allow_none else "")
        raise ConfigError(key, v, allowed)
    return float(v)


def ttl(key: str, v: Any, *, null: str) -> float | None:
    """An idle TTL: 0 would expire every block at once (the tier keeps nothing), so it is refused."""
    if v is None:
        return None
    if not _real(v, 0.0, MAX_TTL_S) or v <= 0:
        raise ConfigError(key, v, f"a positive number of seconds, or null {null}; at most {MAX_TTL_S:g} s")
    return float(v)


def integer(key: str, v: Any, *, minimum: int, maximum: int | None = None, allow_none: bool = False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or (maximum is not None and v > maximum):
        rng = f"an integer in [{minimum}, {maximum}]" if maximum is not None else f"an integer >= {minimum}"
        raise ConfigError(key, v, rng + (" or null" if allow_none else ""))
    return v


def auto_or_int(key: str, v: Any, *, minimum: int = 0, maximum: int | None = None) -> int | str:
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or (maximum is not None and v > maximum):
        rng = f"an integer in [{minimum}, {maximum}]" if maximum is not None else f"an integer >= {minimum}"
        raise ConfigError(key, v, "auto | " + rng)
    return v


def choice(key: str, v: Any, choices: tuple | Callable[[], tuple]) -> Any:
    choices = choices() if callable(choices) else choices
    if isinstance(v, str):
        low = v.strip().lower()
        if low in ("true", "false") and any(isinstance(c, bool) for c in choices):
            v = low == "true"
        else:
            v = low
    for c in choices:
        if v == c and type(v) is type(c):
            return c
    raise ConfigError(key, v, " | ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices))


def word(key: str, v: Any, *, choices: tuple[str, ...], null: str) -> str | None:
    """One of ``choices`` (vLLM's own names, kept upper case; any case is taken), or null (``null``
    says what null means)."""
    if v is None:
        return None
    if isinstance(v, str) and v.strip().upper() in choices:
        return v.strip().upper()
    raise ConfigError(key, v, " | ".join(choices) + f" | null ({null})")


def host(key: str, v: Any) -> str:
    """An address to listen on: an IPv4 or IPv6 literal, or a host name (``0.0.0.0`` or ``::`` is
    every interface, the operator's explicit choice)."""
    import ipaddress

    if isinstance(v, str):
        h = v.strip()
        try:
            ipaddress.ip_address(h)
            return h
        except ValueError:
            if re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                            r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*", h):
                return h
    raise ConfigError(key, v, "an IP address (127.0.0.1, ::1; 0.0.0.0 or :: for every interface) or a host name")


def name(key: str, v: Any) -> str:
    """A short name that is also a file name: letters, digits, '.', '_' and '-', 1 to 64 of them."""
    if isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}", v):
        return v
    raise ConfigError(key, v, "1 to 64 letters, digits, '.', '_' or '-' (not starting with '.')")


def quotas(key: str, v: Any) -> dict[str, float] | None:
    """Per-model caps in GiB: a mapping of model names (as vLLM names the model: its path or hub
    name) to a positive number; null or {}: none (null)."""
    if v is None or v == {}:
        return None
    if not isinstance(v, dict) or len(v) > 64:
        raise ConfigError(key, v, "a mapping of at most 64 model names to GiB (a positive number), or null")
    out = {}
    for m, gb in v.items():
        if not isinstance(m, str) or not m or len(m) > 1024 or "\0" in m:
            raise ConfigError(key, m, "model names: strings of 1 to 1024 characters, no NUL")
        if not _real(gb, 0.0, MAX_GB) or gb <= 0:
            raise ConfigError(f"{key}.{m}", gb, f"a number of GiB > 0, at most {MAX_GB:g}")
        out[m] = float(gb)
    return out


def path(key: str, v: Any, *, what: str, expand: bool = False) -> str | None:
    if v is not None and (not isinstance(v, str) or not v.strip() or "\0" in v):
        raise ConfigError(key, v, f"a {what} path (string, no NUL bytes) or null")
    return (os.path.expanduser(v) if expand else v) if v else None


def url_problem(u: str, cluster: bool) -> str | None:
    """What the remote tier could not use in one url (None: nothing); it takes host, port and db."""
    if "\0" in u:
        return "a NUL byte"
    if any(c.isspace() or ord(c) < 32 for c in u) or "%" in re.sub(r"\[[^\]]*\]", "", u):
        return "whitespace, a control character or a %-escape, which no host, port or db has"
    try:
        s = urlsplit(u)
    except ValueError as e:  # e.g. an unclosed [ipv6
        return str(e)
    hostport = s.netloc.rsplit("]", 1)[-1]
    port = hostport.rsplit(":", 1)[1] if ":" in hostport else ""
    db = s.path[1:] if s.path.startswith("/") else s.path
    if not s.hostname:
        return "no host"
    if port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        return f"port {port!r} is not an integer in [1, 65535]"
    if db and not (db.isascii() and db.isdigit()):
        return f"db {db!r} is not an integer >= 0"
    if cluster and db and int(db) != 0:
        return f"db {db}: a cluster has db 0 only"
    if s.query or s.fragment:
        return "a query or fragment (?..., #...), which the remote tier would ignore"
    return None


def remote_url(key: str, v: Any, cluster: bool):
    urls = v if isinstance(v, list) else [v]
    if v is None:
        return None
    if not urls or (isinstance(v, list) and not cluster and len(urls) != 1):
        raise ConfigError(key, v, "one redis:// or rediss:// url (a list of seed nodes only with cluster: true)")
    for u in urls:
        if isinstance(u, str) and "@" in u:
            raise ConfigError(key, "<a url with credentials>", "a url without credentials: they come from the "
                              "environment only (KVSTORE_REDIS_USERNAME, KVSTORE_REDIS_PASSWORD)")
        allowed = "redis://host[:port][/db] or rediss://... (port 1-65535, db an integer >= 0; a list with " \
                  "cluster: true), or null"
        if not isinstance(u, str) or not u.startswith(("redis://", "rediss://")):
            raise ConfigError(key, u, allowed)
        why = url_problem(u, cluster)
        if why:  # a query or fragment is not shown: '?password=...' is one way to write a credential
            shown = re.split(r"[?#]", u, maxsplit=1)[0]
            raise ConfigError(key, shown + ("?<not shown>" if shown != u else ""), allowed, why)
    return list(urls) if isinstance(v, list) else v
