"""vLLM adapter: ``KVStoreConnector``, registered through vLLM's plugin entry point.

Installing kvstore registers the entry point ``vllm.general_plugins: kvstore =
kvstore.connectors.vllm:register``, so ``--kv-transfer-config '{"kv_connector":"KVStoreConnector",
"kv_role":"kv_both","kv_connector_extra_config":{"config":"agent"}}'`` works without a module
path; ``"kv_connector_module_path":"kvstore.connectors.vllm.connector"`` works too.

The config is checked before the model loads: vLLM loads its plugins in the process that parses
the engine's arguments, and resolves the connector's class while it builds its config there
(``VllmConfig.__post_init__``: whether the connector supports the hybrid KV cache manager), long
before a worker loads the model and builds the connector (42 s later with a tiny model, and
minutes with a real one). ``register`` wraps that class lookup, and ``EngineArgs.create_engine_config``
(which skips the lookup when ``--disable-hybrid-kv-cache-manager`` is given): for ``KVStoreConnector`` it checks
``kv_connector_extra_config`` as ``kvstore config`` does (every key, the DRAM pool against this
machine's memory, the NVMe folder, the metrics port), logs every bad key and raises the first
:class:`~kvstore.config.ConfigError`, the last line of vLLM's traceback. Anything else the check
hits (a bug, a vLLM that calls the lookup differently) is logged and left to the worker, which
checks again when it builds the store.

vLLM builds its config as a pydantic dataclass, which turns any ``ValueError`` raised inside into
a ``ValidationError`` ending in a link to pydantic's docs; a ConfigError is a ValueError, so it
travels as :class:`KVStoreConfigError` (a RuntimeError, which pydantic lets through) with the same
message: the last line of the traceback is the ConfigError's text, naming the key, the value and
what is allowed.
"""

NAME = "KVStoreConnector"


class KVStoreConfigError(RuntimeError):
    """A :class:`~kvstore.config.ConfigError` of ``kv_connector_extra_config``, raised where vLLM
    builds its config (``.error``: the ConfigError; ``.errors``: every bad key)."""

    def __init__(self, errors):
        self.errors = list(errors)
        self.error = self.errors[0]
        more = f" (and {len(self.errors) - 1} more bad key(s), logged above)" if len(self.errors) > 1 else ""
        super().__init__(f"{self.error}{more}")


_checked: set[str] = set()  # the extra configs already checked in this process (the lookup runs often)


def check_extra_config(extra) -> None:
    """Raise :class:`KVStoreConfigError` for a bad ``kv_connector_extra_config`` (every bad key
    logged), else nothing."""
    import json
    import logging

    from kvstore.store.machine import config_errors

    try:
        key = json.dumps(extra, sort_keys=True, default=str)
    except (TypeError, ValueError):
        key = repr(extra)
    if key in _checked:
        return
    from kvstore.store import metrics as store_metrics

    cfg, errors = config_errors(overrides=extra, ports=False)
    port = extra.get("metrics", {}).get("port") if isinstance(extra, dict) and isinstance(extra.get("metrics"),
                                                                                           dict) else None
    if not errors and isinstance(port, int) and port not in store_metrics._serving:  # a store of ours: its own warning
        from kvstore.store.machine import port_error

        errors = [e for e in (port_error(port, cfg.metrics.host),) if e is not None]  # where it will listen
    if errors:
        log = logging.getLogger("vllm.kvstore")
        for e in errors:
            log.error("kvstore: %s", e)
        raise KVStoreConfigError(errors)
    _checked.add(key)


def _checking_lookup(lookup):
    """vLLM's ``KVConnectorFactory.get_connector_class`` with the check above in front."""
    import functools
    import logging

    @functools.wraps(lookup)
    def get_connector_class(cls, kv_transfer_config, *args, **kwargs):
        if getattr(kv_transfer_config, "kv_connector", None) == NAME:
            try:
                check_extra_config(dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}))
            except KVStoreConfigError:
                raise
            except Exception as e:  # never let a bug here stop vLLM: the worker checks again
                logging.getLogger("vllm.kvstore").warning("kvstore: config check skipped (%r); the worker "
                                                          "checks the config when it builds the store", e)
        return lookup(cls, kv_transfer_config, *args, **kwargs)

    get_connector_class.kvstore_checks = True
    return get_connector_class


def _checking_build(build):
    """vLLM's ``EngineArgs.create_engine_config`` with the check above behind it: vLLM resolves the
    connector's class inside it only while it decides on the hybrid KV cache manager, which it
    skips when ``--disable-hybrid-kv-cache-manager`` is given either way."""
    import functools

    @functools.wraps(build)
    def create_engine_config(self, *args, **kwargs):
        cfg = build(self, *args, **kwargs)
        ktc = getattr(cfg, "kv_transfer_config", None)
        if getattr(ktc, "kv_connector", None) == NAME:
            check_extra_config(dict(getattr(ktc, "kv_connector_extra_config", None) or {}))
        return cfg

    create_engine_config.kvstore_checks = True
    return create_engine_config


def register() -> None:
    """Register KVStoreConnector with vLLM's connector factory, and check its config where vLLM
    builds its config and wherever it resolves the connector's class (idempotent)."""
    import sys

    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # vLLM missing or too old: nothing to register
        return
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "kvstore.connectors.vllm.connector", NAME)
    lookup = KVConnectorFactory.__dict__.get("get_connector_class")
    if isinstance(lookup, classmethod) and not getattr(lookup.__func__, "kvstore_checks", False):
        KVConnectorFactory.get_connector_class = classmethod(_checking_lookup(lookup.__func__))
    args = sys.modules.get("vllm.engine.arg_utils")  # loaded where vLLM parses its arguments: it calls us
    build = getattr(getattr(args, "EngineArgs", None), "create_engine_config", None)
    if callable(build) and not getattr(build, "kvstore_checks", False):
        args.EngineArgs.create_engine_config = _checking_build(build)
