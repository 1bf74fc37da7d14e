"""``metrics.port`` with several ranks or engines on one host (issue 32): the first store exports,
the others (other processes) warn and go on, never "address in use"; a port another program holds
is still refused (tests/test_config_trust.py)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from kvstore.bench.common.ports import free_port
from kvstore.config import ConfigError, from_dict
from kvstore.store import KVStore, machine
from kvstore.store.metrics import StoreMetrics
from conftest import FP

HOLD = """
import sys, time
from kvstore.store.metrics import StoreMetrics
m = StoreMetrics(port=int(sys.argv[1]))
print("up", flush=True)
time.sleep(60)
"""


def _free_port() -> int:
    return free_port(host="0.0.0.0")


def test_a_port_another_kvstore_process_exports_is_shared_with_a_warning(caplog):
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        assert machine.kvstore_exports(port)
        assert machine.port_error(port) is None  # the plugin's check and `kvstore config` let it pass
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            m = StoreMetrics(port=port)  # another rank's store: not refused
        m.close()
        assert "exports another kvstore store of this host" in caplog.text
    finally:
        p.kill()
        p.wait()
    t = time.monotonic()
    while machine.port_error(port) is not None and time.monotonic() - t < 5:
        time.sleep(0.05)
    assert not machine.kvstore_exports(port)


def test_a_listener_that_is_not_kvstore_is_not_taken_for_one():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        assert not machine.kvstore_exports(s.getsockname()[1], timeout=0.2)
    finally:
        s.close()


# -- metrics.host (issue 45, finding 4): loopback unless the operator says otherwise ---------------


def other_address() -> str:
    """An address of this machine that is not 127.0.0.1: the one its default route leaves from (a
    UDP connect sends nothing), else 127.0.0.2 (all of 127/8 is this machine's on Linux)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("203.0.113.1", 9))  # TEST-NET-3: only the route is looked up
            addr = s.getsockname()[0]
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    return "127.0.0.2"


def answers(host: str, port: int) -> bool:
    """Does something accept a connection at ``host``:``port``?"""
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def _metrics_text(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_metrics_listen_on_loopback_only_by_default():
    port, other = _free_port(), other_address()
    m = StoreMetrics(port=port)
    try:
        srv, _ = m._server
        assert srv.socket.getsockname() == ("127.0.0.1", port)  # was ("0.0.0.0", port)
        assert "kvstore_store_info" in _metrics_text("127.0.0.1", port)
        assert not answers(other, port), f"metrics answered on {other}"
    finally:
        m.close()


def test_metrics_host_every_interface_is_the_operators_choice(tmp_path):
    """metrics.host: 0.0.0.0, through the config and the store, listens where it did before."""
    port, other = _free_port(), other_address()
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": 0.001, "pin_memory": False},
                               "nvme": {"path": str(tmp_path / "n"), "capacity_gb": 0.01}},
                     "metrics": {"port": port, "host": "0.0.0.0"}})
    with KVStore(cfg, block_bytes=8192, fingerprint=FP) as store:
        assert store.metrics._server[0].socket.getsockname() == ("0.0.0.0", port)
        assert "kvstore_store_info" in _metrics_text(other, port)


def test_the_port_check_binds_where_the_server_will():
    """A port another program holds on another address of this machine is free on loopback (the
    check said "in use", binding 0.0.0.0); one held on loopback, or checked for 0.0.0.0, is not."""
    other = other_address()
    port = free_port(host=other)
    held = socket.socket()
    held.bind((other, port))
    held.listen(1)
    try:
        assert machine.port_error(port) is None
        _, errors = machine.config_errors(overrides={"metrics": {"port": port},
                                                     "tiers": {"dram": {"capacity_gb": 0.1}}})
        assert errors == []
        StoreMetrics(port=port).close()  # and the server binds there indeed
        e = machine.port_error(port, "0.0.0.0")
        assert e is not None and e.key == "metrics.port" and "in use on 0.0.0.0" in e.why
        _, errors = machine.config_errors(overrides={"metrics": {"port": port, "host": "0.0.0.0"},
                                                     "tiers": {"dram": {"capacity_gb": 0.1}}})
        assert [e.key for e in errors] == ["metrics.port"]
    finally:
        held.close()
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen(1)
        e = machine.port_error(port)
        assert e is not None and e.key == "metrics.port" and "in use on 127.0.0.1" in e.why
        with pytest.raises(ConfigError) as ei:
            StoreMetrics(port=port)
        assert str(ei.value) == str(e)


def test_a_metrics_host_not_of_this_machine_names_metrics_host():
    port = _free_port()
    e = machine.port_error(port, "198.51.100.7")  # TEST-NET-2: no interface of this machine has it
    assert e is not None and e.key == "metrics.host" and e.value == "198.51.100.7"
    with pytest.raises(ConfigError) as ei:
        StoreMetrics(port=port, host="198.51.100.7")
    assert str(ei.value) == str(e)


def test_the_vllm_plugins_check_binds_where_the_server_will():
    """The plugin checks an inline metrics.port before the model loads: at metrics.host (it
    checked loopback whatever the host, so a port held on another address passed the check and
    failed at the store's bind, after the model had loaded)."""
    pytest.importorskip("vllm")
    from kvstore.connectors.vllm import KVStoreConfigError, check_extra_config

    other = other_address()
    port = free_port(host=other)
    with socket.socket() as held:
        held.bind((other, port))
        held.listen(1)
        small = {"tiers": {"dram": {"capacity_gb": 0.1}}}
        check_extra_config({**small, "metrics": {"port": port}})  # free on 127.0.0.1, where it listens
        with pytest.raises(KVStoreConfigError) as ei:
            check_extra_config({**small, "metrics": {"port": port, "host": other}})
        assert "metrics.port" in str(ei.value)
