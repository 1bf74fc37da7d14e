"""The one typed, validated config object, built from YAML + inline + environment overrides.

Schema (public; the tuner writes it, the connector reads it)::

    tiers:                 # a section per registered medium (kvstore.tiers.registry), in chain order:
      dram: {capacity_gb, ttl_s, ttl_shared_s, policy, codec, pin_memory, headroom_blocks}
      nvme: {path, capacity_gb, ttl_s, ttl_shared_s, policy, codec, zstd_level, o_direct, write_mode, io_threads, header, engine, engine_depth, admit_after}
      remote: {url, cluster, ttl_s, codec, zstd_level, write_mode, timeout_ms, io_threads}
    io: {async_saves, async_loads, load_only_if_faster}
    metrics: {port, host}
    mode: embedded | node
    node: {name, timeout_ms, max_engines, engine_share, model_quota_gb}
    events: {<medium>: {medium, locality}}   # the same media
    trace_path: null
    trace_tokens: false
    max_hint_ttl_s: null

Sizes are GiB (2**30 bytes). ``ttl_s`` is an idle time: an entry expires ``ttl_s`` seconds
after it was last stored or hit (null = never). ``ttl_shared_s`` is the idle TTL of a block hit by
two or more distinct sessions (a TTL class for system prompts, tool schemas; null = ``ttl_s``); a TTL of 0
would keep nothing and is refused. Unknown keys and bad values raise :class:`ConfigError`, which names
the key, the value and what is allowed (validators: :mod:`kvstore.configfields`). What this machine
can give a config (memory for the DRAM pool, a free metrics port, the NVMe folder) is checked by
:mod:`kvstore.store.machine`, at store start-up and by ``kvstore config``, never here: the tuner builds
configs for other machines.

Precedence, lowest first: built-in defaults < YAML file < ``KVSTORE__A__B=value`` environment
variables < inline overrides (a nested dict, e.g. vLLM's ``kv_connector_extra_config``).
``KVSTORE_CONFIG`` names the file when no path is given. A file is a path, or the name of a config
shipped in the package (``agent``, ``default``: :func:`shipped_configs`), so ``{"config": "agent"}``
works from any folder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from dataclasses import dataclass
from typing import Any, Mapping

import yaml

log = logging.getLogger(__name__)

from kvstore import configfields as F
from kvstore.configfields import ConfigError

GiB = F.GiB
BOOL = F.BOOL
_f, _sec, _Sized = F.field, F.section, F.Sized  # (the names every section here uses)


# -- the config objects -----------------------------------------------------------------------

def _sections(name: str, part: str, doc: str) -> type:
    """A section with one sub-section per registered medium (kvstore.tiers.registry), in chain
    order: ``part`` is the spec's attribute (its ``config`` or its ``events`` dataclass)."""
    from kvstore.tiers.registry import SPECS

    cls = dataclasses.make_dataclass(name, [(s.name, getattr(s, part), _sec(getattr(s, part))) for s in SPECS],
                                     frozen=True)
    cls.__doc__, cls.__module__ = doc, __name__
    return cls


TiersConfig = _sections("TiersConfig", "config", "``tiers.<medium>``: each registered medium's own section.")


@dataclass(frozen=True)
class IoConfig:
    """Where the connector moves bytes (issue 13). ``async_saves``: ``wait_for_save`` only enqueues;
    the gather runs on a copy worker and the engine's blocks stay allocated until it completes.
    ``async_loads``: a hit with blocks below DRAM loads while the request waits
    (``WAITING_FOR_REMOTE_KVS``) and other requests run; ``false`` loads everything inline
    before the forward pass (the first design, kept to measure against)."""

    async_saves: bool = _f(True, F.choice, choices=BOOL)
    async_loads: bool = _f(True, F.choice, choices=BOOL)
    # cut a hit where loading is slower than recomputing (placement.worth_loading; reason
    # slower_than_recompute), from each tier's measured reads and the engine's step cost fitted
    # over its timed forward passes (kvstore.store.stepcost). Measured on the tiny CPU test model (NVMe
    # only): a block costs 0.55 ms to load and 1.4 ms (first) to 25 ms (at 8k) to recompute
    load_only_if_faster: bool = _f(True, F.choice, choices=BOOL)


EventsConfig = _sections("EventsConfig", "events", """Per tier: the ``medium`` and ``locality`` its
BlockStored/BlockRemoved events carry on vLLM's KV-event stream (``--kv-events-config``); medium
null: not announced.""")


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus endpoint. ``host``: where it listens; loopback by default, since its labels
    name the model, the chain root, the namespace and request tags (0.0.0.0: every interface)."""

    port: int | None = _f(None, F.integer, minimum=1, maximum=65535, allow_none=True)
    host: str = _f("127.0.0.1", F.host)


MODES = ("embedded", "node")


@dataclass(frozen=True)
class NodeConfig:
    """The node cache (``mode: node``): one ``kvstore serve`` per host owns the tiers, and every
    engine of the host attaches to it (kvstore.node). ``name``: the daemon's socket, in this user's
    private socket folder (several daemons: several names). ``timeout_ms``: the longest an engine
    waits for one call; a dead or stuck daemon is a miss and a backoff, never an error.
    ``max_engines``: engines served at once. ``engine_share``: the part of the DRAM slots one engine
    may hold pinned or reserved at once, so no engine starves the others. ``tiers.dram.capacity_gb``
    is the host's budget for every model the daemon serves (one LRU across them,
    kvstore.node.budget); ``model_quota_gb``: caps for some models (model name: GiB)."""

    name: str = _f("node", F.name)
    timeout_ms: int = _f(500, F.integer, minimum=1, maximum=60_000)
    max_engines: int = _f(64, F.integer, minimum=1, maximum=4096)
    engine_share: float = _f(0.5, F.number, minimum=0.01, maximum=1.0)
    model_quota_gb: dict = _f(None, F.quotas)


@dataclass(frozen=True)
class StoreConfig:
    tiers: TiersConfig = _sec(TiersConfig)
    io: IoConfig = _sec(IoConfig)
    metrics: MetricsConfig = _sec(MetricsConfig)
    events: EventsConfig = _sec(EventsConfig)
    # embedded: the store lives in the engine (one engine's cache); node: the engine attaches to the
    # host's ``kvstore serve``, whose config then decides the tiers (kvstore.node)
    mode: str = _f("embedded", F.choice, choices=MODES)
    node: NodeConfig = _sec(NodeConfig)
    trace_path: str | None = _f(None, F.path, what="file")
    trace_tokens: bool = _f(False, F.choice, choices=BOOL)  # the trace keeps each prompt's token ids (opt-in)
    # the longest idle TTL a request's hint (kv_transfer_params kvstore.ttl_s) may ask for; longer
    # ones are cut to it. null: the longest ttl_s of the enabled tiers (a hint keeps a block no
    # longer than the operator keeps any block; no cap when a tier never expires)
    max_hint_ttl_s: float | None = _f(None, F.ttl, null="for the longest ttl_s of the enabled tiers")

    @property
    def hint_ttl_cap(self) -> float | None:
        """``max_hint_ttl_s``, or what null stands for (None: no cap)."""
        if self.max_hint_ttl_s is not None:
            return self.max_hint_ttl_s
        ttls = [c.ttl_s for c in self.tier_sections() if c.enabled and hasattr(c, "ttl_s")]
        return None if not ttls or None in ttls else max(ttls)

    def tier_sections(self) -> list:
        """Each registered medium's ``tiers.<name>`` section, in chain order."""
        return [getattr(self.tiers, f.name) for f in dataclasses.fields(self.tiers)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# -- building from plain data -----------------------------------------------------------------


def _key_errors(prefix: str, data: Any, cls) -> list[ConfigError]:
    """A non-mapping section, credentials (RemoteConfig._refuse) and unknown keys, in file order."""
    if not isinstance(data, Mapping):
        return [ConfigError(prefix or "<root>", data, "a mapping")]
    names = [f.name for f in dataclasses.fields(cls)]
    out = []
    for k in data:
        key = f"{prefix}.{k}" if prefix else str(k)
        e = getattr(cls, "_refuse", lambda key, name: None)(key, k)
        if e is None and k not in names:
            e = ConfigError.unknown(key, names)
        if e is not None:
            out.append(e)
    return out


def _build(cls, prefix: str, data: Any, errors: list | None):
    """A config object from plain data, every field checked by the validator its metadata names.
    ``errors`` None: the first bad key raises; a list: every bad key is appended and its default kept."""
    data = {} if data is None else data

    def bad(e: ConfigError) -> None:
        if errors is None:
            raise e
        errors.append(e)

    for e in _key_errors(prefix, data, cls):
        bad(e)
    data = data if isinstance(data, Mapping) else {}
    out: dict[str, Any] = {}
    for f in sorted(dataclasses.fields(cls), key=lambda f: bool(f.metadata.get("needs"))):  # stable
        key = f"{prefix}.{f.name}" if prefix else f.name
        if "section" in f.metadata:
            out[f.name] = _build(f.metadata["section"], key, data.get(f.name), errors)
            continue
        opts = dict(f.metadata["options"], **{n: out[n] for n in f.metadata["needs"]})
        try:
            out[f.name] = f.metadata["check"](key, data.get(f.name, f.default), **opts)
        except ConfigError as e:
            bad(e)
            out[f.name] = f.default
    return cls(**out)


def from_dict(data: Mapping | None, errors: list | None = None) -> StoreConfig:
    """Build and validate a :class:`StoreConfig` from plain nested data (e.g. parsed YAML).

    Pure: nothing here depends on the machine (the tuner builds configs for others);
    :mod:`kvstore.store.machine` checks what this machine can give. With ``errors`` (a list), every
    bad key is appended to it instead of raising the first, and its default kept."""
    return _build(StoreConfig, "", data, errors)


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
_warned_env: set[str] = set()


MAX_YAML_DEPTH = 64  # a config is 4 levels deep; PyYAML's own limit is the interpreter's recursion limit


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one
    silently: a second ``tiers:`` would drop the first one's settings), and nesting deeper than
    MAX_YAML_DEPTH. That depth is ours, not the recursion limit's: the limit is whatever the
    process set last (hypothesis raises it), so 600 levels parsed in one test run and not another."""

    def compose_node(self, parent, index):
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested too deep (more than {MAX_YAML_DEPTH} levels)",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # '<<': merged keys may be overridden
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                except TypeError:
                    continue  # an unhashable key: the safe loader refuses it itself
                if dup:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found the key {key!r} twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str) -> Any:
    """YAML text -> plain data, with the safe loader (nothing is constructed but plain types).
    Raises yaml.YAMLError for anything it cannot read: bad syntax, a key twice, nesting too deep
    for the parser (RecursionError: 1.2 KB of '[' does it), an integer of over 4,300 digits."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError("nested too deep") from None
    except ValueError as e:  # int('1' * 5000): Python's limit on integer digits
        raise yaml.YAMLError(str(e)) from None


def env_overrides(environ: Mapping[str, str]) -> dict:
    """``KVSTORE__TIERS__DRAM__CAPACITY_GB=8`` -> ``{"tiers": {"dram": {"capacity_gb": 8}}}``.

    Values are parsed as YAML scalars, so ``null``, ``true`` and numbers work.
    """
    out: dict = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            if name.startswith("KVSTORE_") and "__" in name and name not in _warned_env:
                # KVSTORE_TIERS__DRAM__...: one underscore short. Warned, not refused: another tool's
                # KVSTORE_DB__HOST must not stop an engine
                _warned_env.add(name)
                log.warning("kvstore: the environment variable %s is not read: a config override is "
                            "%sSECTION__KEY (did you mean %s%s?)", name, ENV_PREFIX, ENV_PREFIX,
                            name[len("KVSTORE_"):].lstrip("_"))
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
        if not parts:
            continue
        if not isinstance(raw, str):
            raise ConfigError(".".join(parts), raw, f"a string (the environment variable {name})")
        try:
            value = parse_yaml(raw)
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


MAX_FILE_BYTES = 1 << 20  # a config is a few KiB; this refuses /dev/zero, a log or a model file
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")  # package data (pyproject)


def shipped_configs() -> list[str]:
    """The names of the store configs shipped in the package (``kvstore/configs/NAME.yaml``; the
    ``bench_*`` files there are the benchmarks' own parameters, not store configs)."""
    try:
        return sorted(n[:-5] for n in os.listdir(SHIPPED_DIR) if n.endswith(".yaml") and not n.startswith("bench_"))
    except OSError:
        return []


def config_file(path: str | os.PathLike) -> str | os.PathLike:
    """``path`` itself, or for a bare name (no folder, no ``.yaml``/``.yml``: ``agent``) the shipped
    config of that name; an unknown name is refused, naming the shipped ones."""
    if isinstance(path, str) and path and os.sep not in path and not path.endswith((".yaml", ".yml")) \
            and "\0" not in path:
        names = shipped_configs()
        if path in names:
            return os.path.join(SHIPPED_DIR, f"{path}.yaml")
        if not os.path.exists(path):
            raise ConfigError("config", path, f"a shipped config name ({', '.join(names) or 'none installed'}) "
                              "or the path of a YAML file")
    return path


def read_yaml(path: str | os.PathLike) -> dict:
    """A config file's mapping (``path``: a file, or a shipped config's name: :func:`config_file`).
    Refused naming ``config``: a path that is not a string, holds a NUL byte or is not a readable
    regular file; more than 1 MiB; not UTF-8 text; not a YAML mapping."""
    if not isinstance(path, (str, os.PathLike)) or "\0" in os.fspath(path):
        raise ConfigError("config", path, "the path of a YAML file (a string without NUL bytes)")
    given, path = path, config_file(path)
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as fh:  # a FIFO: no wait
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise ConfigError("config", str(path), "a regular YAML file (this is a folder or a device)")
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        where = "" if os.path.isabs(path) else f", relative to {os.getcwd()}"  # a relative path names the cwd
        raise ConfigError("config", str(given), f"a readable YAML file, or a shipped config name "
                          f"({', '.join(shipped_configs())})", f"{e.strerror or e}{where}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError("config", str(path), f"a YAML file of at most {MAX_FILE_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("config", str(path), "a UTF-8 text YAML file", f"byte {e.start} is not UTF-8: "
                          "a binary file?") from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as e:  # one line: the problem and where (PyYAML's own text spans several)
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        why = f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark and problem else " ".join(str(e).split())
        raise ConfigError("config", str(path), "valid YAML", why) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError("config", str(path), f"a YAML mapping at the top level, not a {type(data).__name__}")
    return data


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping | None = None,
    environ: Mapping[str, str] | None = None,
    errors: list | None = None,
) -> StoreConfig | None:
    """Defaults < YAML file (``path``, else ``overrides["config"]``, else ``$KVSTORE_CONFIG``) <
    ``KVSTORE__*`` env < ``overrides``. With ``errors`` (a list), every bad key is appended to it
    (see :func:`from_dict`); a file or environment that cannot be read at all appends one error
    and returns None."""
    environ = os.environ if environ is None else environ
    try:
        if overrides is not None and not isinstance(overrides, Mapping):
            raise ConfigError("<overrides>", overrides, "a mapping of config keys (e.g. kv_connector_extra_config)")
        overrides = dict(overrides or {})
        named = overrides.pop("config", None)
        if named is not None and not isinstance(named, (str, os.PathLike)):
            raise ConfigError("config", named, "the path of a YAML file (a string), or null")
        if path is None:
            path = named if named is not None else environ.get("KVSTORE_CONFIG") or None
        if isinstance(path, (str, os.PathLike)) and not os.fspath(path).strip():  # "$CFG" of an unset variable
            raise ConfigError("config", path, "the path of a YAML file or a shipped config name "
                              f"({', '.join(shipped_configs())}), or null for the defaults")
        data: dict = read_yaml(path) if path is not None else {}
        data = merge(data, env_overrides(environ))
    except ConfigError as e:
        if errors is None:
            raise
        errors.append(e)
        return None
    return from_dict(merge(data, overrides), errors)
